"""bench/mismatch: where the trainer's log-probabilities and the rollout's disagree, per pair of engines.

The general specialist's GRPO from the sft checkpoint of the latest `make run` (`BENCH_MISMATCH_RUN` names
another run's report), synchronous (rl.max_staleness 0: the trainer scores each batch with the weights that
sampled it, so any gap is the engines'), for each (train engine, rollout engine) pair: torch/torch,
torch/sglang, megatron/torch, megatron/sglang, all in fp32; torch/torch asynchronous (k=1) for scale; and the
rollouts in bf16 against the fp32 trainer (rl.rollout_dtype, torch and SGLang), what GLM-5's lower-precision
rollouts cost the importance ratio. Per run, over its
steps: `logratio_abs` (mean |log pi_train - log pi_rollout| over the generated tokens, each step's mean over its
micro-batches), `masked_fraction` (the share of tokens the importance-sampling mask drops), and the mean reward.
Figures: each pair's mean over `SEEDS` seeds with the spread (min, max), and `mismatch.png`.

    python -m bench.mismatch     (make bench B=mismatch; needs `make sglang` for the SGLang pairs)

BENCH_SMALL=1: from the smoke run's sft, 2 steps, one seed.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from statistics import mean

from bench import mark, out_dir, sft_inputs, size

SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
OUT = out_dir()
PROFILE = size("tiny-dense", "smoke-dense")
DOMAIN = "general"
STEPS = size(12, 2)
SEEDS = size([0, 1, 2], [0])
# (train engine, rollout engine, max_staleness, what the rollouts generate in)
PAIRS = [("torch", "torch", 0, "float32"), ("torch", "sglang", 0, "float32"), ("megatron", "torch", 0, "float32"),
         ("megatron", "sglang", 0, "float32"), ("torch", "torch", 1, "float32"), ("torch", "torch", 0, "bfloat16"),
         ("torch", "sglang", 0, "bfloat16")]


def _inputs() -> tuple[str, str]:
    return sft_inputs("mismatch", "BENCH_MISMATCH_RUN")


def run(train: str, rollout: str, k: int, dtype: str, seed: int, sft: str, curate: str) -> dict:
    from posttrain.config import load_config
    from posttrain.data import load_tasks
    from posttrain.engines.megatron.layout import Parallel
    from posttrain.rl.loop import train_policy
    cfg = load_config(PROFILE)
    domain = DOMAIN if DOMAIN in cfg.rl.domains else cfg.rl.domains[0]
    r = cfg.rl.for_domain(domain).model_copy(update={
        "steps": STEPS, "max_staleness": k, "rollout_dtype": dtype, "val_every": 0, "checkpoint_every": 0})
    pool, val = load_tasks(curate, "rl", domain), load_tasks(curate, "val", domain)[:4]
    opts = {"parallel": Parallel()} if train == "megatron" else {}
    _, _, st = train_policy(r, sft, pool, val, seed=seed, label=f"{train}/{rollout} k={k}", engine=(train, opts),
                            rollout_engine=rollout)
    h = st.history
    return {"logratio_abs": mean(h["logratio_abs"]), "masked_fraction": mean(h["masked_fraction"]),
            "reward": mean(h["reward"])}


def plot(rows: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    f, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, (name, p) in enumerate(rows.items()):
        a.bar(i, p["logratio_abs_mean"], yerr=[[p["logratio_abs_mean"] - p["logratio_abs_min"]],
                                                [p["logratio_abs_max"] - p["logratio_abs_mean"]]], color=f"C{i}")
        b.bar(i, p["masked_fraction_mean"], color=f"C{i}")
    for ax, label in ((a, "mean |log pi_train - log pi_rollout|"), (b, "share of tokens masked by IS")):
        ax.set_xticks(range(len(rows)), list(rows), rotation=20, fontsize=8)
        ax.set_ylabel(label)
    a.set_yscale("log")
    f.suptitle(title)
    f.tight_layout()
    f.savefig(path, dpi=110)
    plt.close(f)


def main(argv: list[str] | None = None) -> None:
    import torch

    from posttrain.config import load_config
    from posttrain.engines.sglang_server import ServerError, sglang_python
    from posttrain.pipeline.raysupport import ensure_ray
    sft, curate = _inputs()
    ensure_ray(load_config(PROFILE).runtime)
    try:
        sglang_python()
        pairs = PAIRS
    except ServerError as e:
        print(f"bench/mismatch: {e}; the SGLang pairs are skipped")
        pairs = [p for p in PAIRS if p[1] != "sglang"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    fig: dict = {"device": device, "profile": PROFILE, "domain": DOMAIN, "steps": STEPS, "seeds": SEEDS}
    rows: dict[str, dict] = {}
    for train, rollout, k, dtype in pairs:
        runs = [run(train, rollout, k, dtype, seed, sft, curate) for seed in SEEDS]
        bf16 = dtype == "bfloat16"
        name = f"{train}/{rollout}" + (f" k={k}" if k else "") + (" bf16" if bf16 else "")
        row = {}
        for key in ("logratio_abs", "masked_fraction", "reward"):
            xs = [x[key] for x in runs]
            row |= {f"{key}_mean": mean(xs), f"{key}_min": min(xs), f"{key}_max": max(xs)}
        rows[name] = row
        slug = f"{train}_{rollout}" + (f"_k{k}" if k else "") + ("_bf16" if bf16 else "")
        fig |= {f"{key}_{slug}": v for key, v in row.items()}  # one flat object, as every bench writes
        print(f"[mismatch] {name}: |dlogp| {row['logratio_abs_mean']:.2e} (min {row['logratio_abs_min']:.2e}, max "
              f"{row['logratio_abs_max']:.2e}), masked {row['masked_fraction_mean']:.4f}, reward "
              f"{row['reward_mean']:.3f}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    plot(rows, f"train / rollout mismatch ({device}, {STEPS} steps, seeds {SEEDS})", OUT / "mismatch.png")
    (OUT / "mismatch.json").write_text(json.dumps(mark(fig), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
