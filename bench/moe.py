"""bench/moe: GLM-5's mixture-of-experts care on the glm5 preset, over seeds.

Per seed, the pipeline (`posttrain run`, its own POSTTRAIN_HOME under WORK) on PROFILE with SETS: one RL specialist
(reasoning) so the generalist is OPD from it, W4A8 as GLM-5 deploys. From it:
- the expert load's coefficient of variation over base pretraining (aux-loss-free balancing: first and last steps'
  means, MLflow's `moe_cv_first` / `moe_cv_last`);
- W4A8: the largest drop of the quantized model against the generalist over every suite, and the linear weights'
  bytes against bf16.
Then, from that run's sft checkpoint, the same GRPO specialist twice, without and with routing replay
(`rl.routing_replay`), asynchronous (`rl.max_staleness` 1: each batch was sampled by the weights before the last
update, the mismatch replay exists for): per step, the mean |log pi_train - log pi_rollout| over generated tokens
at the start of the step, the clip and importance-sampling mask fractions, the reward, and under replay the share of
replayed routes the trainer's router would have chosen otherwise. Both arms again with the rollouts in bf16, and in
W4A8 (the quantize stage's scheme rounded to nearest at every update), against the fp32 trainer
(`rl.rollout_dtype`): the other mismatch GLM-5's replay is for.

    python -m bench.moe [--seeds 0 1 2]     (make bench B=moe)

BENCH_SMALL=1 (bench/__init__.py): the smoke profile (GLM-5's architecture), one seed, RL_STEPS 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, pstdev

from bench import mark, out_dir, size, threads

OUT = out_dir()
WORK = OUT / "moe-work"
PROFILE = size("tiny", "smoke")
# a shorter ladder than the tiny-glm5 profile's (GLM-5's latent attention and masked sdpa cost ~4x the dense tiny
# model at 512 tokens on this CPU): what the mismatch figures need is a policy that earns some reward
SETS = size(["ramp.stages=[{seq_len: 256, tokens: 409600, lr: 2.0e-3, rope_theta: 20000.0, long_share: 0.5}]",
             "ramp.attention=sdpa",  # one 256-token rung: tiny's DSA adopts at 512
             "sft.steps=400", "sft.seq_len=256", "rl.domains=[reasoning]", "rl.steps=10", "opd.steps=10",
             "eval.n_per_suite=32", "quantize.calib_samples=128"],
            ["rl.domains=[reasoning]"])
SEEDS = size([0, 1, 2], [0])
RL_STEPS = size(20, 2)
# the rollouts' other precisions against the fp32 trainer (rl.rollout_dtype): bf16, and W4A8 as GLM-5 deploys
LOW_PRECISION = (("_bf16", "bfloat16"), ("_w4a8", "w4a8"))


def pipeline(seed: int) -> tuple[Path, dict]:
    """The pipeline run of `seed` (made once): its report, and the base stage's MLflow metrics."""
    from mlflow import MlflowClient
    home = (WORK / f"home-{seed}").resolve()
    done = home / "bench-report.json"
    if not done.exists():
        args = ["run", "--profile", PROFILE, "--set", f"seed={seed}", *(a for kv in SETS for a in ("--set", kv))]
        env = {**os.environ, "POSTTRAIN_HOME": str(home), "RAY_AUTH_MODE": "disabled"}
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "posttrain.cli", *args], env=env, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"bench/moe: the seed-{seed} run failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        report = sorted((home / "runs").glob("*/report.json"), key=lambda f: f.stat().st_mtime)[-1]
        done.write_text(json.dumps({"report": str(report), "wall_s": round(time.perf_counter() - t, 1)}))
    report = json.loads(Path(json.loads(done.read_text())["report"]).read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow.db")
    exp = client.get_experiment_by_name("posttrain")
    runs = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{report['mlflow_run_id']}'")
    base = next(r for r in runs if r.data.tags.get("posttrain.stage") == "base")
    return home, {"report": report, "base": base.data.metrics}


def param_counts(checkpoint: str) -> tuple[int, int]:
    """Total parameters, and those one token runs through (the routed experts it is not sent to left out)."""
    from posttrain.models import moe
    from posttrain.models.preset import load_checkpoint
    model, _ = load_checkpoint(checkpoint)
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for name, router in moe.routers(model):
        experts = model.get_submodule(name.rsplit(".", 1)[0]).experts
        per_expert = sum(p[0].numel() for p in experts.parameters())
        idle += (router.e_score_correction_bias.numel() - router.top_k) * per_expert
    return total, total - idle


def rl_arm(home: Path, report: dict, seed: int, replay: bool, dtype: str = "float32") -> dict:
    """The reasoning specialist from the run's sft checkpoint, asynchronous, with or without routing replay, its
    rollouts in `dtype`."""
    from posttrain.config import load_config
    from posttrain.data import load_tasks
    from posttrain.rl.loop import train_policy
    cfg = load_config(PROFILE, [f"seed={seed}", *SETS])
    r = cfg.rl.for_domain("reasoning").model_copy(update={"routing_replay": replay, "max_staleness": 1,
                                                          "rollout_dtype": dtype, "steps": RL_STEPS, "val_every": 0,
                                                          "checkpoint_every": 0})
    stages = report["stages"]
    cur = stages["curate"]["artifact"]
    t = time.perf_counter()
    _, _, st = train_policy(r, stages["sft"]["artifact"], load_tasks(cur, "rl", "reasoning"),
                            load_tasks(cur, "val", "reasoning"), seed=seed,
                            label=f"moe-{'replay' if replay else 'plain'}-{dtype}",
                            moe=cfg.moe)
    h = st.history
    out = {k: mean(h[k]) for k in ("logratio_abs", "clip_frac", "masked_fraction", "staleness_mean", "reward")}
    out |= {"reward_curve": h["reward"], "logratio_abs_curve": h["logratio_abs"],
            "val_before": h["val_score"][0][1], "val_after": h["val_score"][-1][1],
            "seconds": round(time.perf_counter() - t, 1)}
    if replay:
        out["routes_differ"] = mean(h["routes_differ"])
    return out


def measure(seeds: list[int]) -> dict:
    import torch
    torch.set_num_threads(threads(2))
    per_seed = {}
    for seed in seeds:
        home, got = pipeline(seed)
        report, base = got["report"], got["base"]
        ev = report["eval"]
        drop = {suite: ev["generalist"][suite] - ev["quantized"][suite] for suite in ev["quantized"]}
        total, active = param_counts(report["stages"]["sft"]["artifact"])
        per_seed[seed] = {"total_params": total, "active_params": active,
                          "expert_load_cv_start": base["moe_cv_first"], "expert_load_cv_end": base["moe_cv_last"],
                          "w4a8_drop": drop, "w4a8_drop_max": max(drop.values()),
                          "w4a8_bytes_ratio": report["quantization"]["bytes_ratio_vs_bf16"],
                          **{f"{arm}{suffix}": rl_arm(home, report, seed, arm == "replay", dtype)
                             for suffix, dtype in (("", "float32"), *LOW_PRECISION)
                             for arm in ("no_replay", "replay")}}
        print(f"bench/moe seed {seed}: {json.dumps({k: v for k, v in per_seed[seed].items() if 'replay' not in k})}",
              flush=True)
    runs = list(per_seed.values())

    def agg(get) -> tuple[float, float]:
        xs = [get(x) for x in runs]
        return mean(xs), pstdev(xs)

    fig = {"profile": PROFILE, "sets": SETS, "rl_steps": RL_STEPS, "max_staleness": 1, "seeds": seeds,
           "threads": threads(2), "total_params": runs[0]["total_params"], "active_params": runs[0]["active_params"]}
    for key, get in {"expert_load_cv_start": lambda x: x["expert_load_cv_start"],
                     "expert_load_cv_end": lambda x: x["expert_load_cv_end"],
                     "w4a8_drop_max": lambda x: x["w4a8_drop_max"], "w4a8_bytes_ratio": lambda x: x["w4a8_bytes_ratio"],
                     "logratio_abs_mean_replay": lambda x: x["replay"]["logratio_abs"],
                     "logratio_abs_mean_no_replay": lambda x: x["no_replay"]["logratio_abs"],
                     "clip_frac_replay": lambda x: x["replay"]["clip_frac"],
                     "clip_frac_no_replay": lambda x: x["no_replay"]["clip_frac"],
                     "masked_fraction_replay": lambda x: x["replay"]["masked_fraction"],
                     "masked_fraction_no_replay": lambda x: x["no_replay"]["masked_fraction"],
                     "reward_replay": lambda x: x["replay"]["reward"],
                     "reward_no_replay": lambda x: x["no_replay"]["reward"],
                     "routes_differ_replay": lambda x: x["replay"]["routes_differ"],
                     **{f"{k}_{arm}{suffix}": (lambda x, k=k, arm=arm, suffix=suffix: x[f"{arm}{suffix}"][k])
                        for k in ("logratio_abs", "clip_frac", "masked_fraction", "reward")
                        for arm in ("replay", "no_replay") for suffix, _ in LOW_PRECISION}}.items():
        fig[key], fig[f"{key}_std"] = agg(get)
    fig["per_seed"] = per_seed
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    args = ap.parse_args(argv if argv is not None else [])
    fig = mark(measure(args.seeds))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "moe.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps({k: v for k, v in fig.items() if k != "per_seed"}, indent=1))
    print(f"wrote {OUT / 'moe.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
