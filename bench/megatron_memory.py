"""bench/megatron_memory: which model sizes and sequence lengths each megatron layout fits on 8 x 80 GB, from the
arithmetic below (`per_gpu`), and that arithmetic checked against the memory measured here.

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

The arithmetic: per-GPU memory of training a dense decoder (Llama / Qwen shapes) with megatron-core under a layout:
weights, gradients, optimizer state, activations and the output layer's logits, from the model's config alone. It is
what says which model sizes and sequence lengths a layout fits on 8 x 80 GB (docs/megatron.md).

No library does this arithmetic for our shapes: Megatron's own estimator (`megatron.training.theoretical_memory_usage`)
assumes a GPT MLP of 4h, multi-head attention, and no context parallelism. This follows the same accounting:
bytes per parameter by precision and optimizer (Megatron's distributed-optimizer docs: bf16 parameters with fp32
gradients, main parameters and Adam moments are 18 bytes, or 6 + 12 / dp with the optimizer sharded over the
data-parallel ranks), and activations per token and layer as Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") count them, re-derived for a SwiGLU MLP, grouped-query attention with
rotary embeddings and a fused (flash) attention kernel, which keeps no score matrix, only a log-sum-exp per head.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import mark, out_dir, size

GIB = 2 ** 30


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    head_dim: int = 0      # 0: hidden / heads
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False   # Qwen3

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        """From a Hugging Face config.json (Llama, Qwen2, Qwen3)."""
        kind = cfg.get("model_type", "")
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg.get("num_key_value_heads") or cfg["num_attention_heads"], cfg["intermediate_size"],
                   cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)), cfg.get("head_dim") or 0,
                   bool(cfg.get("attention_bias", kind == "qwen2")), kind == "qwen3")

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_params(self) -> int:
        qkv = (self.heads + 2 * self.kv_heads) * self.d
        return self.hidden * qkv + self.heads * self.d * self.hidden + 3 * self.hidden * self.ffn \
            + 2 * self.hidden + qkv * self.qkv_bias + 2 * self.d * self.qk_norm

    def params(self) -> int:
        return self.layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: bool = False  # full layers: each keeps its input, one at a time is recomputed in the backward

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("dp", self.dp)) if v > 1]
        return " ".join(parts or ["1 GPU"]) + (" sp" if self.sequence_parallel else "")


# bytes per parameter: (weights, gradients, optimizer state); the optimizer's part is divided by dp when sharded
PER_PARAM = {"bf16": (2, 4, 12),   # bf16 weights; fp32 gradient buffer; fp32 main weights + Adam's two moments
             "fp32": (4, 4, 8)}    # fp32 weights and gradients; Adam's two moments


def layer_activation_elems(s: Shape, lay: Layout) -> tuple[float, float]:
    """Elements one layer keeps per token for its backward: (without recompute, with it), on one tensor-parallel
    rank. Replicated across tp (divided only with sequence parallelism): the two norms' inputs and outputs.
    Split across tp: Q, K, V, the rotated Q and K, the attention output, the MLP's gate, up and their product."""
    t, sp = lay.tp, lay.sequence_parallel
    replicated = 4 * s.hidden / (t if sp else 1)
    split = ((s.heads + 2 * s.kv_heads) * s.d + (s.heads + s.kv_heads) * s.d + s.heads * s.d + 3 * s.ffn) / t
    return replicated + split, s.hidden / (t if sp else 1)


def per_gpu(s: Shape, lay: Layout, seq_len: int, micro_batch: int = 1, micro_batches: int = 1,
            precision: str = "bf16") -> dict[str, float]:
    """Bytes on the busiest GPU (pipeline stage 0, which also holds the embedding; the output layer's logits are
    the last stage's, counted here too so one figure bounds both): weights, gradients, optimizer, activations,
    logits and their total. `micro_batches` per optimizer step bound how many a 1F1B pipeline keeps in flight."""
    e = 2 if precision == "bf16" else 4
    w, g, o = PER_PARAM[precision]
    stage_layers = -(-s.layers // lay.pp)
    embed = s.vocab * s.hidden / lay.tp
    params = stage_layers * s.layer_params() / lay.tp + embed * (1 if s.tied and lay.pp == 1 else 2)
    tokens = micro_batch * seq_len / lay.cp  # each context-parallel rank holds its share of every sequence
    full, kept = layer_activation_elems(s, lay)
    in_flight = min(lay.pp, micro_batches)  # 1F1B: stage 0 holds up to pp micro-batches' activations
    lse = 4 * s.heads / lay.tp  # the fused attention kernel's fp32 log-sum-exp per head
    if lay.recompute:  # each layer's input, plus one layer's full set while it is recomputed
        act = tokens * (stage_layers * in_flight * kept * e + full * e + lse)
    else:
        act = tokens * stage_layers * in_flight * (full * e + lse)
    act += tokens * in_flight * s.hidden * e  # the embedding's output
    # the last stage's logits (bf16) and the fp32 softmax vocab-parallel cross-entropy keeps for its gradient
    logits = tokens * s.vocab / lay.tp * (e + 4)
    out = {"weights": params * w, "gradients": params * g,
           "optimizer": params * o / (lay.dp if lay.distributed_optimizer else 1),
           "activations": act, "logits": logits}
    out["total"] = sum(out.values())
    return out


def fits(s: Shape, lay: Layout, seq_len: int, gib: float = 80.0, headroom: float = 0.9, **kw) -> bool:
    """Whether the busiest GPU's total stays under `headroom` of its memory (the rest: the allocator's
    fragmentation, NCCL buffers, the kernels' workspaces)."""
    return per_gpu(s, lay, seq_len, **kw)["total"] <= headroom * gib * GIB


OUT = out_dir()
SEQS = size([1024, 4096], [64, 128])
# Qwen2.5 (config.json on the Hub): hidden, layers, heads, key-value heads, MLP width, vocabulary, tied embeddings
MODELS = {"0.5B": (896, 24, 14, 2, 4864, 151936, True), "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
          "3B": (2048, 36, 16, 2, 11008, 151936, True), "7B": (3584, 28, 28, 4, 18944, 152064, False),
          "14B": (5120, 48, 40, 8, 13824, 152064, False), "32B": (5120, 64, 40, 8, 27648, 152064, False),
          "72B": (8192, 80, 64, 8, 29568, 152064, False)}
LADDER = [4096, 32768, 131072, 200000]
LAYOUTS = ["dp8", "tp2 dp4", "tp8", "tp4 cp2", "tp2 cp4", "cp8", "tp4 pp2", "tp2 pp2 cp2"]


def layout(name: str) -> Layout:
    split = {part[:2]: int(part[2:]) for part in name.split()}
    return Layout(**split, sequence_parallel=split.get("tp", 1) > 1, distributed_optimizer=split.get("dp", 1) > 1,
                  recompute=True)


def measure(path: Path, seq: int, recompute: bool) -> dict[str, float]:
    """Bytes per category at the peak of one profiled step (after a first step that creates AdamW's state)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    from posttrain.engines.megatron.engine import MegatronTrainEngine
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
