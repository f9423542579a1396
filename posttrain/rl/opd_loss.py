"""On-policy distillation objectives on the student's own samples, scored by a teacher.

`sampled` (default): per-token reverse KL through its sampled-token estimate. The advantage of token
x_t is log p_teacher(x_t) - log p_student(x_t); as a policy gradient it is an unbiased gradient of
-KL(student || teacher) and needs only one teacher log-probability per token (Thinking Machines' form).
`full`: the exact per-position reverse KL over the vocabulary. `topk`: the reverse KL between the two
distributions coarsened to the teacher's top-k tokens plus one bin for the rest (a lower bound on the
full KL that needs k numbers per token). Optionally the task reward is mixed in as a sequence advantage.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from posttrain.models.prefix import micro_batches
from posttrain.rl.batches import completion_batch
from posttrain.rl.losses import kl_to_reference, policy_loss


def _read_only_tensor(a) -> torch.Tensor:
    """A tensor over the teacher's [T, V] log-probabilities without a copy. Arrays from Ray's object store are
    read-only, which torch warns about on the user's console; they are only read here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(np.asarray(a))


def reward_advantages(samples: list) -> torch.Tensor:
    """Reward minus the batch mean of the same domain (the student has no group to compare with)."""
    r = torch.tensor([s.reward for s in samples])
    out = torch.zeros_like(r)
    for d in {s.domain for s in samples}:
        rows = torch.tensor([s.domain == d for s in samples])
        out[rows] = r[rows] - r[rows].mean()
    return out


def reverse_kl_terms(logp_all: torch.Tensor, ids: torch.Tensor, sub: list, mode: str) -> torch.Tensor:
    """Per-token reverse KL(student || teacher) [B, T] (0 off generated positions) for `full` and `topk`,
    or the sampled-token estimate log p_s(x) - log p_t(x) for `sampled` (detached: it is an advantage)."""
    B, T, V = logp_all.shape
    kl = torch.zeros(B, T)
    for i, s in enumerate(sub):
        pos = torch.tensor([j for j, m in enumerate(s.gen_mask) if m], dtype=torch.long)
        if pos.numel() == 0:
            continue
        ls = logp_all[i, pos]
        if mode == "sampled":
            t = torch.tensor(s.teacher)
            kl[i, pos] = ls.detach().gather(-1, ids[i, pos, None]).squeeze(-1) - t
        elif mode == "full":
            t = torch.tensor(np.asarray(s.teacher))
            kl[i, pos] = (ls.exp() * (ls - t)).sum(-1)
        else:
            k_ids, k_lp = (torch.tensor(np.asarray(a)) for a in s.teacher)
            ls_k = ls.gather(-1, k_ids.long())
            rest_s = torch.log1p(-ls_k.exp().sum(-1).clamp(max=1 - 1e-6))
            rest_t = torch.log1p(-k_lp.exp().sum(-1).clamp(max=1 - 1e-6))
            kl[i, pos] = (ls_k.exp() * (ls_k - k_lp)).sum(-1) + rest_s.exp() * (rest_s - rest_t)
    return kl


def _at_generated(mask: torch.Tensor, rows: list) -> torch.Tensor:
    """Per-sample values of the generated positions placed at them in the completion layout (0 elsewhere)."""
    values = torch.cat([torch.as_tensor(r, dtype=torch.float) for r in rows]).to(mask.device)
    return torch.zeros(mask.shape, device=mask.device).masked_scatter(mask > 0, values)


def distill_backward(policy, samples: list, *, mode: str = "sampled", coef: float = 1.0,
                     reward_weight: float = 0.0, temperature: float = 1.0, clip_eps: float = 0.2,
                     is_lower: float = 0.5, is_upper: float = 2.0, max_cells: int = 2048,
                     weight: float = 1.0, ref=None, kl_coef: float = 0.0) -> dict[str, float]:
    """Accumulate the gradient of the distillation loss (mean over the batch's generated tokens, times
    `weight`) on `samples`, whose `teacher` field holds their teacher's scores; returns statistics. With `ref` (a
    frozen engine) and `kl_coef`, the loss also holds kl_coef x KL(student || ref) on the sampled tokens (`sampled`
    only): the student kept near where it started while its teachers pull it."""
    n_tokens = float(sum(s.n_generated for s in samples)) or 1.0
    row_adv = (reward_advantages(samples) * reward_weight if reward_weight else torch.zeros(len(samples))
               ).to(policy.device)
    stats: dict[str, float] = {"distill_loss": 0.0, "reverse_kl": 0.0, "distill_masked_fraction": 0.0}
    per_domain: dict[str, list[float]] = {}  # domain -> [KL sum, tokens]
    chunks = [(idx, [samples[i] for i in idx]) for idx in micro_batches(samples, max_cells)]
    batches = [completion_batch(sub, policy.device) for _, sub in chunks]
    refs = [None] * len(chunks)
    if kl_coef and ref is not None:
        with torch.no_grad():
            refs = [ref.logprobs(sub, temperature)[0] for _, sub in chunks]
        stats["kl_ref"] = 0.0
    if mode == "sampled":  # every micro-batch's loss at once: an engine may interleave them (megatron's 1F1B)
        def sampled(idx, sub, b, ref_logp):
            mask = b["mask"]
            teacher = _at_generated(mask, [s.teacher for s in sub])
            share = mask.sum().item() / n_tokens

            def loss_of(logp, ent, stats=False):
                kl = (logp.detach() - teacher) * mask
                adv = -coef * kl + row_adv[idx, None]
                loss, st = policy_loss(logp, b["old_logprobs"], adv * mask, mask, clip_eps=clip_eps,
                                       is_lower=is_lower, is_upper=is_upper, agg="token", n_tokens=n_tokens,
                                       stats=stats)
                if ref_logp is not None:
                    kl_ref = kl_to_reference(logp, ref_logp, mask)
                    loss = loss + kl_coef * kl_ref * share
                    if stats:
                        st["kl_ref"] = kl_ref.item() * share
                return (loss, kl, st) if stats else loss * weight
            return loss_of
        losses = [sampled(idx, sub, b, r) for (idx, sub), b, r in zip(chunks, batches, refs)]
        done = policy.logprob_losses([(sub, f) for (_, sub), f in zip(chunks, losses)], temperature)
        with torch.no_grad():  # the statistics, from the log-probabilities the update used
            results = [f(logp, ent, stats=True) for f, (_, logp, ent) in zip(losses, done)]
    else:
        results = []
        for (idx, sub), b in zip(chunks, batches):
            mask, ids = b["mask"], b["ids"]
            logp = None
            if mode == "topk":  # needs the student's log-probabilities at the teacher's k tokens: the full logits
                logp_all = torch.log_softmax(policy.forward(sub).float() / temperature, -1)
                logp = logp_all.gather(-1, ids[..., None]).squeeze(-1)
                kl = reverse_kl_terms(logp_all, ids, sub, mode)
            else:  # full: the loss's per-token weights known now: the engine may make its gradient at once
                kl_loss, kl = policy.reverse_kl_loss(sub, [_read_only_tensor(s.teacher) for s in sub], temperature,
                                                     coef * mask / n_tokens)
            if reward_weight:
                logp = policy.logprobs(sub, temperature)[0] if logp is None else logp
            loss = kl_loss if mode == "full" else coef * (kl * mask).sum() / n_tokens
            st = {"masked_fraction": 0.0}
            if reward_weight:
                pg, st = policy_loss(logp, b["old_logprobs"], row_adv[idx], mask, clip_eps=clip_eps,
                                     is_lower=is_lower, is_upper=is_upper, agg="token", n_tokens=n_tokens)
                loss = loss + pg
            policy.backward(loss * weight)
            results.append((loss, kl, st))
    for (_, sub), b, (loss, kl, st) in zip(chunks, batches, results):
        mask = b["mask"]
        share = mask.sum().item() / n_tokens
        stats["distill_loss"] += loss.item()
        stats["reverse_kl"] += (kl.detach() * mask).sum().item() / n_tokens
        stats["distill_masked_fraction"] += st["masked_fraction"] * share
        if "kl_ref" in stats:
            stats["kl_ref"] += st["kl_ref"]
        for s, row_kl, row_mask in zip(sub, kl.detach(), mask):
            acc = per_domain.setdefault(s.domain, [0.0, 0.0])
            acc[0] += (row_kl * row_mask).sum().item()
            acc[1] += row_mask.sum().item()
    for d, (kl_sum, n) in per_domain.items():
        stats[f"reverse_kl/{d}"] = kl_sum / max(1.0, n)
    return stats
