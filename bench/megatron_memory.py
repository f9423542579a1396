"""bench/megatron_memory: which model sizes and sequence lengths each megatron layout fits on 8 x 80 GB, from
posttrain.engines.megatron_memory's arithmetic, and that arithmetic checked against the memory measured here.

- Measured: one SFT step (forward, backward, AdamW) of the megatron engine on this machine (fp32, the bench/megatron
  tiny shape, one packed row), under torch's memory profiler, which files every tensor as a parameter, gradient,
  optimizer state or activation; at each sequence length, with and without full-layer recompute. Per category the
  measured bytes at the step's peak against the estimate: `weights_ratio`, `gradients_ratio`, `optimizer_ratio`
  (exact arithmetic: 1.0) and `activations_ratio` (activations and logits together: the measured peak of everything
  that is not a parameter, gradient or optimizer state, over the estimate).
- The table: Qwen2.5's public shapes from 0.5B to 72B, the `real` profile's context ladder (4k, 32k, 128k, 200k),
  bf16 with fp32 gradients and Adam (Megatron's mixed precision), the distributed optimizer, full recompute,
  sequence parallelism with tp, 16 micro-batches a step; per layout of 8 GPUs the busiest GPU's GiB, and whether it
  stays under 90% of 80 GiB.

    python -m bench.megatron_memory     (make bench B=megatron_memory)

BENCH_SMALL=1: sequence lengths 64 and 128.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench import mark, out_dir, size

OUT = out_dir()
SEQS = size([1024, 4096], [64, 128])
# Qwen2.5 (config.json on the Hub): hidden, layers, heads, key-value heads, MLP width, vocabulary, tied embeddings
MODELS = {"0.5B": (896, 24, 14, 2, 4864, 151936, True), "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
          "3B": (2048, 36, 16, 2, 11008, 151936, True), "7B": (3584, 28, 28, 4, 18944, 152064, False),
          "14B": (5120, 48, 40, 8, 13824, 152064, False), "32B": (5120, 64, 40, 8, 27648, 152064, False),
          "72B": (8192, 80, 64, 8, 29568, 152064, False)}
LADDER = [4096, 32768, 131072, 200000]
LAYOUTS = ["dp8", "tp2 dp4", "tp8", "tp4 cp2", "tp2 cp4", "cp8", "tp4 pp2", "tp2 pp2 cp2"]


def layout(name: str):
    from posttrain.engines.megatron_memory import Layout
    split = {part[:2]: int(part[2:]) for part in name.split()}
    return Layout(**split, sequence_parallel=split.get("tp", 1) > 1, distributed_optimizer=split.get("dp", 1) > 1,
                  recompute=True)


def measure(path: Path, seq: int, recompute: bool) -> dict[str, float]:
    """Bytes per category at the peak of one profiled step (after a first step that creates AdamW's state)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    from posttrain.engines.megatron_train import MegatronTrainEngine
    engine = MegatronTrainEngine(path, lr=1e-3, recompute=recompute)
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(3, engine.vocab_size, (1, seq), generator=gen)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}

    def step() -> None:
        engine.backward(engine.lm_loss(batch))
        engine.step()
    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    index = {(c.name if c else "unknown"): i + 1 for c, i in _CATEGORY_TO_INDEX.items()}
    state = {"weights": "PARAMETER", "gradients": "GRADIENT", "optimizer": "OPTIMIZER_STATE"}
    out = {k: max(row[index[c]] for row in sizes) for k, c in state.items()}
    kept = {index[c] for c in state.values()}
    out["activations"] = max(sum(v for j, v in enumerate(row) if j not in kept) for row in sizes)
    out["total"] = max(sum(row) for row in sizes)
    return out


def checked(seqs: list[int]) -> dict:
    from transformers import AutoConfig

    from bench.megatron import checkpoint
    from posttrain.engines.megatron_memory import Layout, Shape, per_gpu
    fig: dict = {}
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint("tiny", Path(d))
        shape = Shape.from_config(AutoConfig.from_pretrained(path).to_dict())
        for seq in seqs:
            for recompute in (False, True):
                got = measure(path, seq, recompute)
                est = per_gpu(shape, Layout(recompute=recompute), seq, precision="fp32")
                est["activations"] += est["logits"]
                name = f"s{seq}{'_recompute' if recompute else ''}"
                fig[name] = {**{f"{k}_measured_mb": round(got[k] / 2**20, 3) for k in got},
                             **{f"{k}_estimated_mb": round(est[k] / 2**20, 3) for k in got},
                             **{f"{k}_ratio": round(got[k] / est[k], 3) for k in got}}
                print(f"[megatron_memory] measured / estimated at {name}: "
                      + ", ".join(f"{k} {fig[name][f'{k}_ratio']}" for k in got), flush=True)
    return fig


def table() -> dict:
    from posttrain.engines.megatron_memory import GIB, Shape, fits, per_gpu
    rows = {}
    for model, (h, n, a, g, f, v, tied) in MODELS.items():
        shape = Shape(h, n, a, g, f, v, tied)
        for seq in LADDER:
            rows[f"{model}@{seq}"] = {
                lay: {"gib": round(per_gpu(shape, layout(lay), seq, micro_batches=16)["total"] / GIB, 1),
                      "fits": fits(shape, layout(lay), seq, micro_batches=16)} for lay in LAYOUTS}
    return rows


def markdown(rows: dict) -> str:
    lines = ["| model @ tokens | " + " | ".join(LAYOUTS) + " |", "|---" * (len(LAYOUTS) + 1) + "|"]
    for name, cells in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{'**' if c['fits'] else ''}{c['gib']}{'**' if c['fits'] else ''}"
                                                 for c in cells.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    fig = {"device": f"cpu ({os.cpu_count()} cores)", "precision_measured": "fp32", "shape_measured": "tiny",
           "checked": checked(SEQS), "gpu_gib": 80, "headroom": 0.9, "micro_batches": 16, "layouts": LAYOUTS,
           "table": table()}
    print(markdown(fig["table"]))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "megatron_memory.json").write_text(json.dumps(mark(fig), indent=1) + "\n")
    (OUT / "megatron_memory.md").write_text(markdown(fig["table"]) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
