"""The megatron engine's optimizer step: the gradients summed and averaged over the ranks that hold the same
parameters, clipped by a norm that counts tensor-parallel shards once each, then AdamW (the torch engine's, through
`posttrain.engines.optim`) and the learning-rate schedule.

Gradients: the data-parallel ranks' gradients are averaged with one all-reduce per step; with sequence parallelism the
norms' gradients (computed on each rank's slice of the sequence) are summed over the tensor-parallel group, as
Megatron's DDP does. Megatron's own DDP and distributed optimizer hard-code CUDA devices and streams, so they are not
used here.

The distributed optimizer (`megatron.distributed_optimizer`, `Shards`), ZeRO stage 1: the AdamW moments of parameters
that several ranks hold alike (data-parallel replicas, context-parallel ranks, and for a MoE model the dense layers
over the expert-parallel ranks) are split among those ranks, each parameter's to one owner. Every rank still gets
every gradient (the all-reduce above); an owner steps its parameters and broadcasts them to the others. The optimizer
state per rank falls from 2 x params x 4 bytes to about that over the group's size.

Why our own: Megatron's DistributedOptimizer runs on its DDP's contiguous gradient buffers, which hard-code CUDA;
torch's ZeroRedundancyOptimizer splits over one process group, while a MoE model's experts repeat over another group
(expert data parallel) than its dense layers, and it gathers its state on one rank to save it, where Megatron's
distributed checkpoint has each rank write the moments it owns (`owned_moment`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from posttrain.engines import optim
from posttrain.engines.megatron import context_parallel
from posttrain.engines.megatron.layout import Parallel
from posttrain.engines.megatron.pipeline_stages import Pipeline


class Optimizer:
    """AdamW at `lr` on the trained parameters of `model` (this rank's share of them with `distributed`), and what a
    step does around it. `moe`: the model has experts (their own replicas' group); `embedding`: the weight on this
    stage whose gradient is summed with its pipeline peer's (the first stage's embedding and the last stage's copy of
    it), None where none is."""

    def __init__(self, model: torch.nn.Module, pipe: Pipeline, parallel: Parallel, device, lr: float,
                 weight_decay: float = 0.0, *, distributed: bool = False, moe: bool = False,
                 embedding: Callable[[], torch.Tensor] | None = None):
        self.model, self.pipe, self.parallel, self.device = model, pipe, parallel, device
        self.moe, self.embedding = moe, embedding
        self.shards = shards(model) if distributed else None
        trained = [p for p in model.parameters() if p.requires_grad]  # not GLM-5's frozen indexers
        # through the module: a test sets AdamW's eps for every engine there
        self.opt = optim.make_optimizer(self.shards.mine if self.shards else trained, lr, weight_decay)
        self.sched: torch.optim.lr_scheduler.LambdaLR | None = None

    def sync_grads(self) -> None:
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        if self.embedding is not None and ps.is_rank_in_embedding_group():
            # the first stage's embeddings and the last stage's copy of them (its output layer when tied, else the
            # draft layer's): one weight, whose gradient is the sum of both uses
            w = self.embedding()
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=ps.get_embedding_group())
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.parallel.sequence_parallel:  # norms saw their rank's slice of the sequence: sum the slices
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        # the replicas' gradients are averaged; a replica's context-parallel ranks each hold the gradient of their
        # slice of the sequence, which add up. An expert split over expert-parallel ranks already holds the gradient
        # of every token the all-to-all sent it, from each of those ranks: it sums over its own replicas only
        dp = ps.get_data_parallel_world_size()
        for shared, group in ((True, ps.get_data_parallel_group(with_context_parallel=True)),
                              (False, ps.get_expert_data_parallel_group() if self.moe else None)):
            mine = [p for p in params if getattr(p, "allreduce", True) == shared]
            if not mine or dp == 1 and context_parallel.size() == 1:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in mine]) / dp
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            at = 0
            for p in mine:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()

    def grad_norm(self) -> torch.Tensor:
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        experts = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            if p.grad is None or getattr(p, "shared", False):  # the last stage's copy of tied embeddings: once
                continue
            sq = p.grad.float().pow(2).sum()
            if not getattr(p, "allreduce", True):  # an expert split over expert-parallel ranks
                experts += sq
            elif getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.parallel.tp > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        if self.parallel.ep > 1:
            dist.all_reduce(experts, group=ps.get_expert_tensor_and_model_parallel_group())
        total = sharded + replicated + experts
        if self.pipe.size > 1:  # each stage holds its own layers
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        return total.sqrt()

    def step(self, max_grad_norm: float = 1.0) -> torch.Tensor:
        """Sync, clip, step, schedule, zero the gradients; the gradient norm before clipping."""
        self.sync_grads()
        norm = self.grad_norm()
        coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        self.opt.step()
        if self.shards:
            self.shards.broadcast()
        if self.sched:
            self.sched.step()
        self.model.zero_grad(set_to_none=True)  # the distributed optimizer's holds only its own parameters
        return norm

    def with_schedule(self, schedule: Callable[[int], float], lr: float) -> None:
        """`lr` times `schedule(step)` from now on."""
        for group in self.opt.param_groups:
            group["lr"] = group["initial_lr"] = lr
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]


def shards(model: torch.nn.Module) -> Shards:
    """The distributed optimizer's split of `model`'s trained parameters: the dense ones over the data-parallel (and
    context-parallel) ranks, which hold them alike; a MoE model's experts over their own replicas (expert data
    parallel)."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    return Shards([(dense, ps.get_data_parallel_group(with_context_parallel=True)),
                   (experts, ps.get_expert_data_parallel_group() if experts else None)])


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
