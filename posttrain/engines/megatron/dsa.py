"""GLM-5's DeepSeek sparse attention (DSA) in the Megatron engine: each latent-attention layer's core attention keeps
only the keys its indexer selects, as transformers' GlmMoeDsaForCausalLM does.

Why not megatron-core's own `DSAttention` (0.16): it rotates the indexer's queries and keys by a Hadamard transform
(bf16 and the `fast_hadamard_transform` CUDA package only), applies RoPE to the other half of the head than GLM-5
does (transformers' interleaved rope on the first `qk_rope_head_dim` dims), layer-norms the keys under its own names,
selects with an unstable `topk`, has no cross-layer sharing (GLM-5's IndexShare: `indexer_types` "shared" layers reuse
the previous full layer's selection) and ignores document and padding masks in its attention. Here the indexer *is*
transformers' `GlmMoeDsaIndexer` (as `posttrain.models.glm5.StableIndexer`, its stable selection), held by the core
attention under the checkpoint's names, so the selection is the torch engine's by construction; the attention is the
engine's SDPA under the allowed-and-selected mask.

Rows no longer than `index_topk` select every key: they skip the indexer (dense attention, as before). RoPE in the
indexer runs at the row's sequence positions: within a packed row's document that is a constant offset, which RoPE's
scores do not see.

The ramp's DSA adoption trains the indexers here as the torch engine does (`train_indexers`): each layer adds the
KL from its attention distribution to its group indexer's scores (`posttrain.models.dsa.indexer_loss`, the torch
path's function) and attaches it to its output, so the backward that reaches the layer (from the LM loss, or from
the next pipeline stage) also backpropagates the KL into the indexer, with the weight the engine set for the
micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding

from kernels.dsa import selected_mask
from posttrain.engines.megatron import context_parallel
from posttrain.models.dsa import DSAState, indexer_loss
from posttrain.models.glm5 import DENSE_TOPK, StableIndexer


def adopted(hf_config) -> bool:
    """Whether the checkpoint attends sparsely: its indexers keep fewer keys than any row has."""
    return getattr(hf_config, "index_topk", DENSE_TOPK) < DENSE_TOPK


def groups(hf_config) -> list[int]:
    """For each layer, the layer whose indexer selects its keys (itself, or the last full layer before a shared
    one)."""
    types = getattr(hf_config, "indexer_types", None) or ["full"] * hf_config.num_hidden_layers
    out, group = [], 0
    for i, kind in enumerate(types):
        group = i if kind == "full" else group
        out.append(group)
    return out


def check(hf_config, par, recompute: bool, where: str = "megatron") -> None:
    """Refuse a split under which a shared layer would not find its full layer's selection (once DSA is adopted:
    before, no layer selects)."""
    if not adopted(hf_config):
        return
    g = groups(hf_config)
    per = hf_config.num_hidden_layers // par.pp
    cut = [i for i in range(per, hf_config.num_hidden_layers, per) if g[i] != i]
    if cut:
        raise ValueError(f"{where}.pp: layer {cut[0]} shares layer {g[cut[0]]}'s DSA selection (indexer_types "
                         f"'shared') but would start another pipeline stage; pick a pp whose stages begin at a "
                         f"'full' layer")
    if recompute and par.pp > 1 and any(a != i for i, a in enumerate(g)):
        # a recomputed shared layer would read the selection of the micro-batch forwarded last
        raise ValueError(f"{where}.recompute: not with pp > 1 on a checkpoint with shared DSA layers "
                         f"(indexer_types 'shared'); set one of them off")


def train_indexers(gpt, hf_config, mode: str, kl_queries: int):
    """The model's indexers learning (the ramp's DSA adoption): their weights trainable, and a
    `posttrain.models.dsa.DSAState` collecting their losses on every layer. `warmup`: every key kept, the rest of
    the model frozen, the indexers learning the dense attention; `sparse`: the selected keys, the model trains on."""
    st = DSAState(hf_config.index_topk, kl_queries)
    st.mode, st.collect, st.weight, st.length = mode, True, 1.0, None  # the engine sets weight and length
    if mode == "warmup":
        gpt.requires_grad_(False)
    for layer in gpt.decoder.layers:
        attention = layer.self_attention.core_attention
        attention.dsa_state = st
        if attention.indexer is not None:
            attention.indexer.dsa_state = st
            attention.indexer.requires_grad_(True)
    return st


def _sum_over_context(n: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(n, group=context_parallel.group())
    return n


class _Attach(torch.autograd.Function):
    """`out` unchanged; the backward that reaches it gives `loss` the gradient `weight` (Megatron's
    `DSAIndexerLossAutoScaler`, with the weight fixed at the forward: micro-batches in flight each keep theirs)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full((), ctx.weight), None


def attach(out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
    """`out`, whose backward also backpropagates `loss` times `weight` (`_Attach`)."""
    return _Attach.apply(out, loss, weight)


def recomputing() -> bool:
    """Whether this forward is activation recomputation inside a backward (its figures were counted in the first)."""
    return torch._C._current_graph_task_id() != -1


def allowed_keys(mask: torch.Tensor | None, queries: torch.Tensor, length: int) -> torch.Tensor:
    """[b, s, length] True where this rank's queries (at sequence positions `queries` [s]) may see a key, from the
    engine's mask: None (causal), Megatron's bool [b, 1, s, length] (True = masked) or document ids [b, length] (-1 on
    padding)."""
    keys = torch.arange(length, device=queries.device)
    causal = queries[:, None] >= keys[None]
    if mask is None:
        return causal[None]
    if mask.dtype == torch.bool:
        return ~mask[:, 0]
    same = (mask[:, queries, None] == mask[:, None, :]) & (mask[:, None, :] >= 0)
    return (same & causal) | (queries[:, None] == keys[None])


def core_attention(base: type, hf_config) -> type:
    """`base` (the engine's SDPA core attention) narrowed to each query's DSA selection; one class per model: its
    layers share the selections of this forward (IndexShare) through it."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    layer_group = groups(hf_config)
    rope = GlmMoeDsaRotaryEmbedding(hf_config)  # not a submodule: no parameters, and no state to save
    selections: dict[int, torch.Tensor] = {}

    class DsaAttention(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.index = self.layer_number - 1  # global, 0-based: transformers' layer index
            self.group = layer_group[self.index]
            self.indexer = StableIndexer(hf_config, self.index) if self.group == self.index else None
            self.dsa_state = None  # set while the indexers train (`train_indexers`)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, x=None, qr=None):
            s, b = query.shape[:2]
            cp = context_parallel.size()
            length = s * cp  # with context parallelism this rank's queries see the whole sequence's keys
            topk = self.indexer.index_topk if self.indexer is not None else hf_config.index_topk
            st = self.dsa_state
            if length <= topk and st is None:  # every key kept: dense
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            queries = torch.arange(s, device=query.device) if cp == 1 else context_parallel.positions(
                length, cp, ps.get_context_parallel_rank(), query.device)
            allowed = allowed_keys(attention_mask, queries, length).expand(b, -1, -1)
            if self.indexer is not None:  # its keys computed here, at this rank's positions, then gathered
                gather = None if cp == 1 else \
                    lambda k: context_parallel.GatherKV.apply(k.transpose(0, 1)).transpose(0, 1)
                selections[self.index] = self.indexer(x.transpose(0, 1), qr.transpose(0, 1),
                                                      rope.to(x.device)(x, queries[None].expand(b, s)), allowed,
                                                      gather_keys=gather)
            chosen = allowed & selected_mask(selections[self.group], length)
            chosen |= ~chosen.any(-1, keepdim=True)  # a padding query that selects nothing: no NaN
            out = super().forward(query, key, value, ~chosen[:, None], attn_mask_type, attention_bias,
                                  packed_seq_params)
            if st is not None and st.collect and torch.is_grad_enabled():  # shared layers train their group's too
                self._indexer_loss(st, query, key, queries, allowed)
                out = attach(out, st.losses[-1], st.weight)
                if recomputing():  # computed again for the checkpoint's saved tensors, counted once
                    st.losses.pop(), st.recalls.pop()
            return out

        def _indexer_loss(self, st, query, key, queries: torch.Tensor, allowed: torch.Tensor) -> None:
            """The torch ramp's indexer loss on the same strided queries of the whole sequence: with context
            parallelism each rank scores those it holds, against the whole sequence's keys, as its share."""
            scores, key, total = st.scores[self.group], key.detach(), None
            length = st.length or allowed.shape[-1]  # the rows' own length: not the tail padded for the cp chunks
            rows = torch.linspace(0, length - 1, min(length, st.kl_queries), device=queries.device).long()
            if context_parallel.size() > 1:
                key, total = context_parallel.GatherOutput.apply(key), _sum_over_context
                rows = torch.nonzero(torch.isin(queries, rows)).flatten()
            q, k = (t.detach().permute(1, 2, 0, 3) for t in (query, key))  # [s, b, n, d] -> [b, n, s, d]
            indexer_loss(st, q, k, self.softmax_scale, scores, allowed, selections[self.group], rows, total)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            """The indexer too (Megatron's core attention saves only its own softmax offset): replicated over tp."""
            # megatron-core only after layout.cpu_patches (layout.py)
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            if self.indexer is not None:
                out.update(make_sharded_tensors_for_checkpoint(
                    self.indexer.state_dict(prefix="", keep_vars=True), f"{prefix}indexer.", {}, sharded_offsets,
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
            return out
    return DsaAttention


def pop_stats(st, stages: int) -> dict[str, float]:
    """The step's indexer KL (mean over its layers' losses, as the torch ramp's) and top-k recall of the dense
    attention mass in `st` (`train_indexers`' state), over every pipeline stage's layers and context-parallel rank's
    queries; {} without one."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    losses, recalls = st.losses, st.recalls
    st.losses, st.recalls = [], []
    st.scores.clear()
    sums = torch.tensor([float(sum(x.item() for x in losses)), len(losses),
                         float(sum(x.item() for x in recalls)), len(recalls)], dtype=torch.float64)
    if stages > 1:
        dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())
    if context_parallel.size() > 1:  # each rank's losses are its share of its queries' (counts: the same)
        shares = sums[[0, 2]].clone()
        dist.all_reduce(shares, group=context_parallel.group())
        sums[[0, 2]] = shares
    if not sums[1]:
        return {}
    return {"indexer_kl": (sums[0] / sums[1]).item(), "topk_recall": (sums[2] / sums[3]).item()}
