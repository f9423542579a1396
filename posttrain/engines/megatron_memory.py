"""Per-GPU memory of training a dense decoder (Llama / Qwen shapes) with megatron-core under a layout: weights,
gradients, optimizer state, activations and the output layer's logits, from the model's config alone. It is what
says which model sizes and sequence lengths a layout fits on 8 x 80 GB (docs/megatron.md), and bench/megatron_memory
checks it against the memory measured at the sizes that run here.

No library does this arithmetic for our shapes: Megatron's own estimator (`megatron.training.theoretical_memory_usage`)
assumes a GPT MLP of 4h, multi-head attention, and no context parallelism. This follows the same accounting:
bytes per parameter by precision and optimizer (Megatron's distributed-optimizer docs: bf16 parameters with fp32
gradients, main parameters and Adam moments are 18 bytes, or 6 + 12 / dp with the optimizer sharded over the
data-parallel ranks), and activations per token and layer as Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") count them, re-derived for a SwiGLU MLP, grouped-query attention with
rotary embeddings and a fused (flash) attention kernel, which keeps no score matrix, only a log-sum-exp per head."""
from __future__ import annotations

from dataclasses import dataclass

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
