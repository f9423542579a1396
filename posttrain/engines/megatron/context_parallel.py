"""Context parallelism for the megatron engine without Transformer Engine: each of the `cp` ranks of a model replica
holds a slice of every sequence, and attention gathers the keys and values of the whole sequence.

Megatron runs context parallelism only in Transformer Engine's attention (a ring of CUDA kernels), which has no CPU
build; its local attention refuses `context_parallel_size > 1`. The split is Megatron's own, so its RoPE (which
slices the rotary table the same way) and Transformer Engine's attention agree with it: the sequence is cut into
2 x cp chunks and rank r holds chunks r and 2cp-1-r, so every rank gets the same share of the causal mask's work.
The keys and values are all-gathered (Llama 3's form of context parallelism, against a ring's overlapped
send/receive): one collective per layer, and memory for one layer's whole-sequence keys and values at a time.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def group():
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    return ps.get_context_parallel_group()


def size() -> int:
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    return ps.get_context_parallel_world_size()


def chunk_order(cp: int) -> list[int]:
    """The chunks in the order an all-gather over the ranks stacks them: rank 0's two, rank 1's two, ..."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The sequence positions rank `rank` holds of a sequence of `length` (a multiple of 2 x cp), in order."""
    c = length // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in (rank, 2 * cp - 1 - rank)])


def rope_slice(emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's `get_pos_emb_on_this_cp_rank` on the embedding's own device (Megatron's moves the index to CUDA)."""
    cp, rank = cp_group.size(), cp_group.rank()
    return emb.index_select(seq_dim, positions(emb.shape[seq_dim], cp, rank, emb.device))


def _gather(x: torch.Tensor) -> torch.Tensor:
    """[s, ...] slices of every rank -> [cp * s, ...] in sequence order (chunks restored from `chunk_order`)."""
    cp = size()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group())
    chunks = torch.cat(parts).view(2 * cp, x.shape[0] // 2, *x.shape[1:])
    return chunks[torch.tensor(chunk_order(cp), device=x.device).argsort()].flatten(0, 1)


def _mine(full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole-sequence tensor [cp * s, ...] in sequence order."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    return full.index_select(0, positions(full.shape[0], size(), ps.get_context_parallel_rank(), full.device))


class GatherKV(torch.autograd.Function):
    """Keys or values of the whole sequence; backward: each rank's slice gets the gradient every rank's queries
    gave it (summed: an all-reduce, since gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group())
        return _mine(grad)


class GatherOutput(torch.autograd.Function):
    """Hidden states of the whole sequence on every rank, for a loss every rank computes alike; backward: this
    rank's slice of its own gradient (the other ranks hold the same gradient for theirs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _mine(grad)


class SharedGrad(torch.autograd.Function):
    """A weight applied to hidden states every rank gathered alike (`GatherOutput`): each rank's gradient for it is
    the whole one, and the engine sums the ranks' gradient shares, so each keeps 1/cp of it."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad / size()


def shared(w: torch.Tensor | None) -> torch.Tensor | None:
    """`w` as used after `GatherOutput` (its gradient a share, `SharedGrad`); itself with one rank."""
    return w if w is None or size() == 1 else SharedGrad.apply(w)


def local_mask(mask: torch.Tensor | None, length: int, batch: int, device) -> torch.Tensor:
    """The attention mask of this rank's queries against the whole sequence's keys [b, 1, s_local, length] (True:
    may not see), from the whole mask [b, 1, length, length], or causal when there is none."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    q = positions(length, size(), ps.get_context_parallel_rank(), device)
    if mask is None:
        return (q[:, None] < torch.arange(length, device=device)[None])[None, None].expand(batch, 1, -1, -1)
    return mask[:, :, q]


def query_runs(length: int) -> list[tuple[int, int]]:
    """The contiguous runs of sequence positions this rank's queries hold, in the order its tensors stack them."""
    cp = size()
    if cp == 1:
        return [(0, length)]
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    c, r = length // (2 * cp), ps.get_context_parallel_rank()
    return [(k * c, (k + 1) * c) for k in (r, 2 * cp - 1 - r)]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                       scale: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention inside each document of packed rows without a [T, T] mask (16 GB a row at 128k tokens): one
    scaled_dot_product_attention per (row, query run, document), whose keys are the document's up to the run's last
    query, causal from the bottom right (on CUDA, flash attention then holds no mask at all).

    q [b, heads, s, d] at this rank's positions (`query_runs`); k, v [b, groups, T, d] the whole sequence;
    segments [b, T]: a document is a run of equal ids (padding runs too: no real token sees them, and no real
    token's loss depends on what they see)."""
    T = k.shape[2]
    runs, rows = query_runs(T), []
    for b in range(q.shape[0]):
        cuts = (torch.nonzero(segments[b, 1:] != segments[b, :-1]).flatten() + 1).tolist()
        docs = list(zip([0, *cuts], [*cuts, T]))
        pieces, local = [], 0
        for qs, qe in runs:
            for ds, de in docs:
                a, e = max(qs, ds), min(qe, de)
                if a >= e:
                    continue
                qq = q[b:b + 1, :, local + a - qs:local + e - qs]
                kk, vv = k[b:b + 1, :, ds:e], v[b:b + 1, :, ds:e]
                mask = None if a == ds else causal_lower_right(e - a, e - ds)
                pieces.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=a == ds,
                                                             scale=scale, enable_gqa=gqa))
            local += qe - qs
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows)
