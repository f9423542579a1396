"""bench/partial: GLM-5's partial rollouts against updates that wait for the generations in flight.

The general specialist's GRPO from the sft checkpoint of the latest `make run` (`BENCH_MISMATCH_RUN` names another
run's report), at the profile's RL settings but asynchronous (rl.max_staleness 1) with two rollout workers, each
owning an SGLang server, in three arms: updates that wait for each server's running requests (`wait`, the
default), updates that reach generations in flight (`partial`, rl.partial_rollouts) with the weights through Ray's
object store, and the same with the trainer broadcasting to both servers in one process group (`partial
broadcast`, runtime.weight_sync broadcast). Per run, over its steps: `token_staleness` (how many versions behind
the trainer each generated token was), `sample_staleness` (a sample's oldest token), `mixed_version_share` (samples
spanning an update), `logratio_abs` (mean |log pi_train - log pi_rollout|, what staleness costs the importance
ratio), `masked_fraction`, `steps_per_s`, the trainer's `rollout_wait_s` and `push_s` per step, and the reward.
Figures: each arm's mean over `SEEDS` seeds with the spread (min, max).

    python -m bench.partial     (make bench B=partial; needs `make sglang`)

BENCH_SMALL=1: from the smoke run's sft, 2 steps, one seed.
"""
from __future__ import annotations

import json
import os
import sys
from statistics import mean

from bench import mark, out_dir, size
from bench.mismatch import DOMAIN, PROFILE, _inputs

SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
OUT = out_dir()
STEPS = size(12, 2)
SEEDS = size([0, 1, 2], [0])
WORKERS = 2
ARMS = {"wait": (False, "store"), "partial": (True, "store"), "partial_broadcast": (True, "broadcast")}
KEYS = ("token_staleness", "sample_staleness", "mixed_version_share", "logratio_abs", "masked_fraction",
        "steps_per_s", "rollout_wait_s", "push_s", "reward")


def run(partial: bool, sync: str, seed: int, sft: str, curate: str) -> dict:
    from posttrain.config import load_config
    from posttrain.data import load_tasks
    from posttrain.rl.loop import train_policy
    cfg = load_config(PROFILE)
    domain = DOMAIN if DOMAIN in cfg.rl.domains else cfg.rl.domains[0]
    r = cfg.rl.for_domain(domain).model_copy(update={
        "steps": STEPS, "max_staleness": 1, "partial_rollouts": partial, "rollout_workers": WORKERS,
        "val_every": 0, "checkpoint_every": 0})
    pool, val = load_tasks(curate, "rl", domain), load_tasks(curate, "val", domain)[:4]
    _, _, st = train_policy(r, sft, pool, val, seed=seed, label=f"{'partial' if partial else 'wait'}/{sync}",
                            rollout_engine="sglang", weight_sync=sync)
    h = st.history
    # without partial rollouts every token of a sample has the sample's version
    tokens = h.get("token_staleness_mean", h["staleness_mean"])
    return {"token_staleness": mean(tokens), "sample_staleness": mean(h["staleness_mean"]),
            "mixed_version_share": mean(h.get("mixed_version_share", [0.0])),
            "logratio_abs": mean(h["logratio_abs"]), "masked_fraction": mean(h["masked_fraction"]),
            "steps_per_s": STEPS / h["wall_s"][-1], "rollout_wait_s": mean(h["rollout_wait_s"]),
            "push_s": mean(h["push_s"]), "reward": mean(h["reward"])}


def main(argv: list[str] | None = None) -> None:
    import torch

    from posttrain.config import load_config
    from posttrain.engines.sglang_server import ServerError, sglang_python
    from posttrain.pipeline.raysupport import ensure_ray
    try:
        sglang_python()
    except ServerError as e:
        print(f"bench/partial: {e}; nothing to measure")
        return
    sft, curate = _inputs()
    ensure_ray(load_config(PROFILE).runtime)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    fig: dict = {"device": device, "profile": PROFILE, "domain": DOMAIN, "steps": STEPS, "seeds": SEEDS,
                 "rollout_workers": WORKERS, "max_staleness": 1, "rollout_engine": "sglang"}
    for arm, (partial, sync) in ARMS.items():
        runs = [run(partial, sync, seed, sft, curate) for seed in SEEDS]
        for key in KEYS:
            xs = [x[key] for x in runs]
            fig |= {f"{key}_{arm}_mean": mean(xs), f"{key}_{arm}_min": min(xs), f"{key}_{arm}_max": max(xs)}
        print(f"[partial] {arm}: " + ", ".join(f"{k} {fig[f'{k}_{arm}_mean']:.4g}" for k in KEYS), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "partial.json").write_text(json.dumps(mark(fig), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
