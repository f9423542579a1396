"""Log-probabilities, entropies and the reverse KL over a vocabulary split across tensor-parallel ranks: each rank
holds the logits of its slice [tokens, V/tp], and only per-token maxima and sums cross the ranks, so no rank builds
the full [tokens, vocab] logits. Megatron's own `vocab_parallel_cross_entropy` gives the log-probability alone; the
RL losses need the entropy and OPD the full-vocabulary KL too.

Gradients: a sum over ranks is an all-reduce whose backward is the identity (Megatron's
`reduce_from_tensor_model_parallel_region`); log Z, the same on every rank, feeds each rank's own slice of the
distribution, so the gradients of those uses are summed over the ranks (`copy_to_tensor_model_parallel_region`'s
backward). With one rank both are no-ops."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _group():
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    return ps.get_tensor_model_parallel_group()


def _sum(x: torch.Tensor) -> torch.Tensor:
    # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    return reduce_from_tensor_model_parallel_region(x, group=_group())


def log_softmax(logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: float) -> torch.Tensor:
    """This rank's slice of log softmax(logits / temperature) [n, V/tp], its first column global id `vocab_start`;
    ids at or past `vocab_size` (the padding to a multiple of tp) get probability 0."""
    # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    z = logits.float() / temperature
    if vocab_start + z.shape[-1] > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
        z = z.masked_fill(ids >= vocab_size, float("-inf"))
    if dist.get_world_size(_group()) == 1:
        return torch.log_softmax(z, -1)
    top = z.detach().max(-1, keepdim=True).values
    dist.all_reduce(top, dist.ReduceOp.MAX, group=_group())
    log_z = top + _sum((z - top).exp().sum(-1, keepdim=True)).log()
    return z - copy_to_tensor_model_parallel_region(log_z, group=_group())


def _plogq(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum over the slice of p * x, with 0 * -inf = 0 (padded and impossible ids)."""
    return torch.where(p > 0, p * x, torch.zeros_like(p)).sum(-1)


def token_scores(logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: float, *,
                 target: torch.Tensor, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probability of each `target` id, entropy or None), both [n] and the same on every rank."""
    ls = log_softmax(logits, vocab_start, vocab_size, temperature)
    local = target - vocab_start
    here = (local >= 0) & (local < ls.shape[-1])
    picked = ls.gather(-1, local.clamp(0, ls.shape[-1] - 1)[:, None]).squeeze(-1)
    logp = _sum(torch.where(here, picked, torch.zeros_like(picked)))
    return logp, -_sum(_plogq(ls.exp(), ls)) if entropy else None


def reverse_kl(logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: float, *,
               teacher: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) [n] over the whole vocabulary; `teacher`: its log-probabilities [n, vocab] (all of
    them: each rank reads its slice; ids past the teacher's vocabulary have teacher probability 0)."""
    ls = log_softmax(logits, vocab_start, vocab_size, temperature)
    end = vocab_start + ls.shape[-1]
    lt = teacher.float()[:, vocab_start:end]
    if lt.shape[-1] < ls.shape[-1]:
        lt = torch.nn.functional.pad(lt, (0, ls.shape[-1] - lt.shape[-1]), value=float("-inf"))
    return _sum(_plogq(ls.exp(), ls - lt))
