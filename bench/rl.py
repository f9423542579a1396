"""bench/rl: (a) asynchronous rollouts (k=1) against synchronous (k=0): same sft checkpoint, seeds, prompts
and deployment (one Ray rollout worker beside the trainer, one thread each, 2 CPUs), wall time until the
validation accuracy that sync reaches at the end of its run (the mean of its last 3 evaluations); (b) our GRPO against TRL's GRPOTrainer on the
same policy, environment (general, `BENCH_RL_DOMAIN`), prompts, batch shape (16 prompts x 8 samples, one update per batch),
loss (the tiny profile's: aggregation, clip, temperature, lr, no KL) and machine: optimizer steps per second and mean reward after n steps.

The policy is the sft checkpoint of the latest `make run` (`BENCH_RL_RUN` picks another run's report).
Wall times include validation (64 greedy episodes every 2 steps) on both sides of (a); (b) has none.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

STEPS = int(os.environ.get("BENCH_RL_STEPS", 40))
TRL_STEPS = int(os.environ.get("BENCH_RL_TRL_STEPS", 20))
DOMAIN = os.environ.get("BENCH_RL_DOMAIN", "general")  # its validation score moves within tens of steps
OUT = Path(".posttrain/bench")


def _inputs() -> tuple[str, str]:
    report = Path(os.environ.get("BENCH_RL_RUN", ".posttrain/latest/report.json"))
    if not report.exists():
        sys.exit(f"bench/rl needs an sft checkpoint: {report} does not exist; run `make run` first")
    stages = json.loads(report.read_text())["stages"]
    return stages["sft"]["artifact"], stages["curate"]["artifact"]


def _rl_config(overrides: dict):
    from posttrain.config import load_config
    r = load_config("tiny").rl.for_domain(DOMAIN)
    return r.model_copy(update={"val_every": 2, "checkpoint_every": 0, **overrides})


def _ours(k: int, steps: int, val_every: int) -> dict:
    """One specialist run (child process: its own Ray, its own clock)."""
    import ray
    import torch

    from posttrain.curate import load_tasks
    from posttrain.raysupport import ensure_ray
    from posttrain.config import RuntimeConfig
    from posttrain.rl import specialist
    torch.set_num_threads(1)
    ensure_ray(RuntimeConfig())
    sft, curate = _inputs()
    r = _rl_config({"max_staleness": k, "steps": steps, "val_every": val_every})
    pool, val = load_tasks(curate, "rl", DOMAIN), load_tasks(curate, "val", DOMAIN)
    _, _, st = specialist(r, sft, pool, val, seed=0, label=f"bench k={k}")
    ray.shutdown()
    h = st.history
    return {"wall_s": st.wall_s, "train_wall_s": h["wall_s"][-1], "val": h["val_score"], "val_wall": h["val_wall_s"],
            "reward": h["reward"],
            "masked_fraction": h["masked_fraction"], "dropped": st.dropped, "staleness": st.staleness}


def _trl(steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import environments
    from posttrain.curate import load_tasks
    torch.set_num_threads(2)
    sft, curate = _inputs()
    r = _rl_config({})
    tok = AutoTokenizer.from_pretrained(sft)
    tasks = load_tasks(curate, "rl", DOMAIN)
    rows = [{"prompt": tok.apply_chat_template(t.messages(), tokenize=False, add_generation_prompt=True,
                                               enable_thinking=True), "idx": i} for i, t in enumerate(tasks)]
    verify = environments.get(DOMAIN).verify

    def reward(prompts, completions, completion_ids, idx, **_):
        # decode ourselves: TRL's `completions` drop special tokens, and with them the think block's tags
        return [verify(tasks[i], tok.decode(ids, skip_special_tokens=False))[0] for i, ids in zip(idx, completion_ids)]

    args = GRPOConfig(output_dir=str(OUT / "rl-trl"), per_device_train_batch_size=r.prompts_per_step * r.group_size,
                      num_generations=r.group_size, max_completion_length=r.max_new_tokens, learning_rate=r.lr,
                      beta=0.0, temperature=r.temperature, epsilon=r.clip_eps, max_steps=steps,
                      loss_type="grpo" if r.loss_agg == "sequence" else "dapo",  # = our aggregation
                      use_cpu=True, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_dropout=True,
                      lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, weight_decay=0.0)
    model = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    return {"wall_s": wall, "reward": rewards}


def _child(what: str, *args) -> dict:
    out = OUT / f"rl-{what}.json"
    subprocess.run([sys.executable, "-m", "bench.rl", what, *map(str, args)], check=True)
    return json.loads(out.read_text())


def _time_to(val: list, wall: list, target: float) -> float | None:
    """Wall seconds at the first evaluation after step 0 that reaches `target`."""
    return next((w for (step, v), (_, w) in zip(val, wall) if step > 0 and v >= target - 1e-9), None)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    _inputs()  # fail early with the message
    sync = _child("ours", 0, STEPS, 2)
    target = sum(v for _, v in sync["val"][-3:]) / 3  # sync's final accuracy, smoothed over its last 3 evaluations
    asyn = _child("ours", 1, int(STEPS * 1.5), 2)  # room to reach the target if staleness slows learning
    sync_wall, async_wall = _time_to(sync["val"], sync["val_wall"], target), _time_to(asyn["val"], asyn["val_wall"], target)
    cmp = _child("ours", 1, TRL_STEPS, 0)  # no validation: TRL runs none either
    trl = _child("trl", TRL_STEPS)
    n = 5  # reward after n steps: the mean of the last 5 steps' batch rewards
    fig = {
        "target_val_accuracy": target, "sync_wall_s": sync_wall, "async_wall_s": async_wall,
        "async_wall_ratio": async_wall / sync_wall if async_wall and sync_wall else None,
        "sync_steps_per_s": STEPS / sync["wall_s"], "async_steps_per_s": int(STEPS * 1.5) / asyn["wall_s"],
        "steps": TRL_STEPS, "steps_per_s": TRL_STEPS / cmp["train_wall_s"], "steps_per_s_trl": TRL_STEPS / trl["wall_s"],
        "reward_after_n": sum(cmp["reward"][-n:]) / n, "reward_after_n_trl": sum(trl["reward"][-n:]) / n,
        "masked_token_fraction": sum(asyn["masked_fraction"]) / len(asyn["masked_fraction"]),
        "stale_dropped": asyn["dropped"], "staleness_async": asyn["staleness"],
        "val_sync": sync["val"], "val_async": asyn["val"], "val_wall_sync": sync["val_wall"],
        "val_wall_async": asyn["val_wall"],
    }
    fig["steps_ratio_vs_trl"] = fig["steps_per_s"] / fig["steps_per_s_trl"]
    (OUT / "rl.json").write_text(json.dumps(fig, indent=1))
    _plot(fig, OUT / "rl.png")
    for k, v in fig.items():
        if not isinstance(v, (list, dict)):
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


def _plot(fig: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    f, ax = plt.subplots(figsize=(6, 3.5))
    for name, label in (("sync", "sync (k=0)"), ("async", "async (k=1)")):
        ax.plot([w for _, w in fig[f"val_wall_{name}"]], [v for _, v in fig[f"val_{name}"]], "o-", label=label)
    ax.axhline(fig["target_val_accuracy"], ls=":", c="grey", label="target (sync's final, smoothed)")
    ax.set(xlabel="wall seconds", ylabel="validation accuracy", title=f"rl {DOMAIN}: time to accuracy")
    ax.legend(loc="lower right")
    f.tight_layout()
    f.savefig(path, dpi=110)
    plt.close(f)


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    result = _ours(*map(int, rest)) if what == "ours" else _trl(int(rest[0]))
    (OUT / f"rl-{what}.json").write_text(json.dumps(result))
