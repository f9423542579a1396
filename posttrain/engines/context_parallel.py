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


def group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def size() -> int:
    from megatron.core import parallel_state as ps
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
    from megatron.core import parallel_state as ps
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


def local_mask(mask: torch.Tensor | None, length: int, batch: int, device) -> torch.Tensor:
    """The attention mask of this rank's queries against the whole sequence's keys [b, 1, s_local, length] (True:
    may not see), from the whole mask [b, 1, length, length], or causal when there is none."""
    from megatron.core import parallel_state as ps
    q = positions(length, size(), ps.get_context_parallel_rank(), device)
    if mask is None:
        return (q[:, None] < torch.arange(length, device=device)[None])[None, None].expand(batch, 1, -1, -1)
    return mask[:, :, q]
