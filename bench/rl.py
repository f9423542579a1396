"""bench/rl, from the sft checkpoint of the latest `make run` (`BENCH_RL_RUN` names another run's report).

(a) Asynchronous rollouts (k=1) against synchronous (k=0) on the general specialist as the tiny profile
trains it (GRPO): same seeds, prompts and deployment (one Ray rollout worker beside the trainer, one
thread each, 2 CPUs). Figure: wall seconds until the validation accuracy 90% of the way from the start to
sync's final (mean of its last 3 evaluations), on curves averaged over 3 seeds; validation is 200 greedy
episodes of the val split every 8 steps, inside the wall time of both.

(b) Our GRPO against TRL's GRPOTrainer on the general domain: same policy, prompts, batch shape (16 prompts
x 8 samples, one update per batch), loss settings (the tiny profile's aggregation, clip, temperature, lr,
no KL) and machine. Figures: optimizer steps per second (no validation on either side) and the mean batch
reward of the last 5 of n steps.
Like for like: TRL is synchronous (generate, then update), so the comparison is our synchronous loop
(rl.max_staleness=0): `steps_ratio_vs_trl_sync`. TRL's one process has both cores' threads; ours takes turns
between the trainer and the rollout worker, so each has both cores' threads too (`rl.worker_threads=2`); the
deployment of (a), one thread each, is the side figure `steps_per_s_sync_1thread`. Our asynchronous loop (k=1,
one thread each) against the same TRL run stays beside it as its own figure (`steps_per_s`, `steps_ratio_vs_trl`).
Settings on each side: ours fp32, no activation checkpointing. TRL at its best on this machine, set
explicitly and recorded as `trl_config` (TRL 1.16 defaults to bf16 and gradient checkpointing; bf16 is ~3x
slower on this CPU): `bf16=False`, `gradient_checkpointing=False`; sampling top_p=1, top_k=0 (plain
temperature sampling, as ours). `BENCH_RL_TRL_DEFAULTS=1` adds TRL at its own defaults (bf16, checkpointing),
labelled `_trl_defaults`.

BENCH_SMALL=1 (bench/__init__.py): from the smoke run's sft with the smoke profile's RL settings, 2 steps (3 async),
one seed, 8 validation tasks every step, the runs without validation that only repeat one with it (same k and
threads) not run again, every run in this process (bench/__init__.py: `children_in_process`); TRL's side only
where TRL is installed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import children_in_process, mark, out_dir, peer, release_ray, sft_inputs, size, small

SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROFILE = size("tiny-dense", "smoke-dense")
STEPS = int(os.environ.get("BENCH_RL_STEPS", size(48, 2)))
TRL_STEPS = int(os.environ.get("BENCH_RL_TRL_STEPS", size(20, 2)))
SEEDS = int(os.environ.get("BENCH_RL_SEEDS", size(3, 1)))
VAL_TASKS = size(200, 8)  # the general world holds 236 distinct val problems
VAL_EVERY = size(8, 1)
ASYNC_DOMAIN = os.environ.get("BENCH_RL_ASYNC_DOMAIN", "general")
DOMAIN = os.environ.get("BENCH_RL_DOMAIN", "general")  # GRPO, as TRL's GRPOTrainer
TRL_DEFAULTS = os.environ.get("BENCH_RL_TRL_DEFAULTS", "0") == "1"
TRL_THREADS = 2   # TRL's one process: both cores
SYNC_THREADS = 2  # our synchronous loop against it: trainer and rollout worker take turns, each with both cores
# TRL's best settings on this machine, set explicitly (TRL 1.16 defaults: bf16=True, gradient_checkpointing=True)
TRL_BEST = {"bf16": False, "gradient_checkpointing": False}
OUT = out_dir()


def _inputs() -> tuple[str, str]:
    return sft_inputs("rl", "BENCH_RL_RUN")


def _rl_config(overrides: dict, domain: str = DOMAIN):
    from posttrain.config import load_config
    r = load_config(PROFILE).rl.for_domain(domain)
    return r.model_copy(update={"val_every": 2, "checkpoint_every": 0, **overrides})


def _ours(k: int, steps: int, val_every: int, seed: int = 0, domain: str = DOMAIN, threads: int = 1) -> dict:
    """One specialist run (child process: its own Ray, its own clock); `threads` torch threads for the trainer
    and for the rollout worker each."""
    import torch

    from posttrain.data import load_tasks
    from posttrain.pipeline.raysupport import ensure_ray
    from posttrain.config import RuntimeConfig
    from posttrain.rl.loop import mean_step_times, train_policy
    threads = int(threads)
    torch.set_num_threads(threads)
    ensure_ray(RuntimeConfig())
    sft, curate = _inputs()
    r = _rl_config({"max_staleness": k, "steps": steps, "val_every": val_every, "worker_threads": threads}, domain)
    # a validation set 3x the pipeline's (same generator, val split): time to accuracy needs a steady curve
    import environments
    from posttrain.config import load_config
    val = environments.get(domain).generate("val", VAL_TASKS, 0, **load_config(PROFILE).world.knobs())
    pool = load_tasks(curate, "rl", domain)
    _, _, st = train_policy(r, sft, pool, val, seed=seed, label=f"bench k={k} seed {seed}")
    release_ray()
    h = st.history
    return {"wall_s": st.wall_s, "train_wall_s": h["wall_s"][-1], "val": h["val_score"], "val_wall": h["val_wall_s"],
            "reward": h["reward"],
            "masked_fraction": h["masked_fraction"], "dropped": st.dropped, "staleness": st.staleness,
            "step_times": mean_step_times(h)}


def _trl(steps: int, defaults: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import environments
    from posttrain.data import load_tasks
    torch.set_num_threads(TRL_THREADS)
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

    # defaults: bf16 and gradient checkpointing left at TRL's own defaults (the labelled side figure)
    args = GRPOConfig(**({} if defaults else TRL_BEST), top_p=1.0, top_k=0,
                      output_dir=str(OUT / "rl-trl"), per_device_train_batch_size=r.prompts_per_step * r.group_size,
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
    config = {k: getattr(args, k) for k in (
        "bf16", "fp16", "gradient_checkpointing", "activation_checkpointing", "top_p", "top_k", "temperature",
        "loss_type", "beta", "epsilon", "num_iterations", "num_generations", "max_completion_length", "use_vllm",
        "torch_compile",
    )}  # as it ran
    return {"wall_s": wall, "reward": rewards, "trl_config": config}


def _child(what: str, *args) -> dict:
    """`python -m bench.rl what args` (its own process, Ray and clock); small mode: the same in this process, Ray
    kept up between children (a child process would spend ~15 s of its ~18 starting Ray and its workers)."""
    out = OUT / f"rl-{what}.json"
    if children_in_process():
        _run(what, list(map(str, args)))
    else:
        subprocess.run([sys.executable, "-m", "bench.rl", what, *map(str, args)], check=True)
    return json.loads(out.read_text())


def _run(what: str, rest: list[str]) -> None:
    result = _ours(*map(int, rest[:4]), *rest[4:]) if what == "ours" else _trl(int(rest[0]), rest[1:] == ["defaults"])
    (OUT / f"rl-{what}.json").write_text(json.dumps(result))


def _mean_curve(runs: list[dict]) -> tuple[list, list]:
    """Validation accuracy and wall seconds at each evaluation, averaged over seeds."""
    n = len(runs)
    val = [(step, sum(r["val"][i][1] for r in runs) / n) for i, (step, _) in enumerate(runs[0]["val"])]
    wall = [(step, sum(r["val_wall"][i][1] for r in runs) / n) for i, (step, _) in enumerate(runs[0]["val"])]
    return val, wall


def _time_to(val: list, wall: list, target: float) -> float | None:
    """Wall seconds at the first evaluation after step 0 that reaches `target`."""
    return next((w for (step, v), (_, w) in zip(val, wall) if step > 0 and v >= target - 1e-9), None)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    _inputs()  # fail early with the message
    with_trl = peer("trl", "rl")  # likewise: at full size TRL must be installed
    # one seed's curve crosses a plateau by chance: average SEEDS runs per mode, same seeds for both
    syncs = [_child("ours", 0, STEPS, VAL_EVERY, seed, ASYNC_DOMAIN) for seed in range(SEEDS)]
    # async gets 1.5x the steps: room to reach the target if staleness slows learning
    asyns = [_child("ours", 1, int(STEPS * 1.5), VAL_EVERY, seed, ASYNC_DOMAIN) for seed in range(SEEDS)]
    sync_val, sync_wall_curve = _mean_curve(syncs)
    async_val, async_wall_curve = _mean_curve(asyns)
    start, final = sync_val[0][1], sum(v for _, v in sync_val[-3:]) / len(sync_val[-3:])
    target = start + 0.9 * (final - start)  # 90% of the gain sync reaches: below its noisy plateau
    sync_wall, async_wall = _time_to(sync_val, sync_wall_curve, target), _time_to(async_val, async_wall_curve, target)
    sync, asyn = syncs[0], asyns[0]
    # small mode: the runs without validation that repeat a run above (same k, same threads) are that run
    cmp = asyns[0] if small() else _child("ours", 1, TRL_STEPS, 0)  # no validation: TRL runs none either
    # synchronous, as TRL is: the like-for-like comparison. Trainer and worker take turns, so each gets both
    # cores' threads, as TRL's one process does; the one-thread deployment of (a) is a side figure
    cmp_sync = _child("ours", 0, TRL_STEPS, 0, 0, DOMAIN, SYNC_THREADS)
    cmp_sync_1 = syncs[0] if small() else _child("ours", 0, TRL_STEPS, 0)
    trl = _child("trl", TRL_STEPS) if with_trl else None
    trl_d = _child("trl", TRL_STEPS, "defaults") if TRL_DEFAULTS and with_trl else None
    n = min(5, TRL_STEPS)  # reward after n steps: the mean of the last 5 steps' batch rewards
    fig = {
        "async_domain": ASYNC_DOMAIN, "trl_domain": DOMAIN, "target_val_accuracy": target,
        "sync_wall_s": sync_wall, "async_wall_s": async_wall,
        "async_wall_ratio": async_wall / sync_wall if async_wall and sync_wall else None,
        "sync_steps_per_s": STEPS / sync["wall_s"], "async_steps_per_s": int(STEPS * 1.5) / asyn["wall_s"],
        "start_val_accuracy": start, "sync_final_val_accuracy": final,
        # seconds per step, async over sync, all seeds: the overlap alone, whatever staleness does to learning
        "step_time_ratio": (sum(r["train_wall_s"] for r in asyns) / (1.5 * STEPS))
                           / (sum(r["train_wall_s"] for r in syncs) / STEPS),
        "steps": TRL_STEPS, "steps_per_s": TRL_STEPS / cmp["train_wall_s"],
        "steps_per_s_trl": TRL_STEPS / trl["wall_s"] if trl else None,
        "reward_after_n": sum(cmp["reward"][-n:]) / n,
        "reward_after_n_trl": sum(trl["reward"][-n:]) / n if trl else None,
        "masked_token_fraction": sum(asyn["masked_fraction"]) / len(asyn["masked_fraction"]),
        "stale_dropped": asyn["dropped"], "staleness_async": asyn["staleness"],
        "seeds": SEEDS, "val_sync": sync_val, "val_async": async_val, "val_wall_sync": sync_wall_curve,
        "val_wall_async": async_wall_curve,
    }
    fig["steps_ratio_vs_trl"] = fig["steps_per_s"] / fig["steps_per_s_trl"] if trl else None  # ours async over TRL
    fig |= {"steps_per_s_sync": TRL_STEPS / cmp_sync["train_wall_s"],
            "reward_after_n_sync": sum(cmp_sync["reward"][-n:]) / n,
            "steps_per_s_sync_1thread": TRL_STEPS / cmp_sync_1["train_wall_s"],
            **({"trl_config": trl["trl_config"], "trl_bf16": trl["trl_config"]["bf16"],
                "trl_gradient_checkpointing": trl["trl_config"]["gradient_checkpointing"]} if trl else {}),
            "ours_config": {"bf16": False, "gradient_checkpointing": False, "max_staleness_sync": 0,
                            "max_staleness_async": 1, "temperature": _rl_config({}).temperature,
                            "threads_sync": SYNC_THREADS, "threads_async": 1, "threads_trl": TRL_THREADS}}
    fig["steps_ratio_vs_trl_sync"] = fig["steps_per_s_sync"] / fig["steps_per_s_trl"] if trl else None  # the headline
    fig |= {f"sync_step_{k}": v for k, v in cmp_sync["step_times"].items()}
    if trl_d:  # TRL at its own defaults (bf16, gradient checkpointing): a side figure, not the comparison
        fig |= {"trl_defaults_config": trl_d["trl_config"], "steps_per_s_trl_defaults": TRL_STEPS / trl_d["wall_s"],
                "reward_after_n_trl_defaults": sum(trl_d["reward"][-n:]) / n}
        fig["steps_ratio_vs_trl_defaults_sync"] = fig["steps_per_s_sync"] / fig["steps_per_s_trl_defaults"]
    fig = mark(fig)
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
    ax.axhline(fig["target_val_accuracy"], ls=":", c="grey", label="target (90% of sync's gain)")
    ax.set(xlabel="wall seconds", ylabel="validation accuracy", title=f"rl {ASYNC_DOMAIN}: time to accuracy")
    ax.legend(loc="lower right")
    f.tight_layout()
    f.savefig(path, dpi=110)
    plt.close(f)


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2:])
