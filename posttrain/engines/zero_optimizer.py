"""The megatron engine's distributed optimizer (`megatron.distributed_optimizer`), ZeRO stage 1: the AdamW moments
of parameters that several ranks hold alike (data-parallel replicas, context-parallel ranks, and for a MoE model the
dense layers over the expert-parallel ranks) are split among those ranks, each parameter's to one owner. Every rank
still gets every gradient (the engine's all-reduce); an owner steps its parameters and broadcasts them to the others.
The optimizer state per rank falls from 2 x params x 4 bytes to about that over the group's size.

Why our own: Megatron's DistributedOptimizer runs on its DDP's contiguous gradient buffers, which hard-code CUDA;
torch's ZeroRedundancyOptimizer splits over one process group, while a MoE model's experts repeat over another group
(expert data parallel) than its dense layers, and it gathers its state on one rank to save it, where Megatron's
distributed checkpoint has each rank write the moments it owns (`owned_moment`)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


def owners(sizes: list[int], ranks: int) -> list[int]:
    """The owning rank of each parameter (by element count): largest first, each to the rank holding the fewest
    elements so far. Deterministic: every rank of a group computes the same plan."""
    load = [0] * ranks
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += sizes[i]
    return out


class Shards:
    """Which of `groups` ([(parameters, process group)]: the parameters the group's ranks hold alike) this rank steps
    (`mine`), and the broadcast that brings every rank the others' updates."""

    def __init__(self, groups: list[tuple[list[torch.nn.Parameter], object]]):
        self.mine: list[torch.nn.Parameter] = []
        self.plan = []  # (group, [(owner's global rank, its parameters)])
        for params, group in groups:
            if not params:
                continue
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            rank = dist.get_rank(group) if dist.is_initialized() else 0
            if size > len(params):
                raise ValueError(f"megatron.distributed_optimizer: {len(params)} parameters cannot be split over "
                                 f"{size} ranks; set it false")
            own = owners([p.numel() for p in params], size)
            self.mine += [p for p, r in zip(params, own) if r == rank]
            if size > 1:
                self.plan.append((group, [(dist.get_global_rank(group, r), [p for p, o in zip(params, own) if o == r])
                                          for r in range(size)]))

    @torch.no_grad()
    def broadcast(self) -> None:
        """Each owner's stepped parameters to the other ranks of its group, one flat tensor per owner."""
        for group, by_owner in self.plan:
            for src, params in by_owner:
                flat = torch.cat([p.reshape(-1) for p in params])
                dist.broadcast(flat, src=src, group=group)
                if src != dist.get_rank():
                    at = 0
                    for p in params:
                        p.copy_(flat[at:at + p.numel()].view_as(p))
                        at += p.numel()


def owned_moment(sharded):
    """A moment this rank owns as its parameter's sharded tensor marks it: the parameter's data-parallel replica id
    (the last of Megatron's three) becomes 0, so this rank writes it: no other rank holds it."""
    rid = sharded.replica_id
    return dataclasses.replace(sharded, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0)
