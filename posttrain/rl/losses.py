"""RL objectives: GRPO group advantages, GAE for critic PPO, the clipped policy loss with double-sided
importance-sampling masks, the clipped value loss. All tensors are aligned to targets: position j
scores the token predicted by logits[:, j]; `mask` is 1 on tokens the policy generated."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: reward minus its group mean, over the group std (zero for groups with one outcome)."""
    g = rewards.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()


def gae(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns; the episode's reward arrives after its last generated token.

    Tool-output tokens (mask 0) are not actions: the trajectory is the generated tokens in order, so a
    tool result sits between two actions as part of the environment's transition."""
    adv = torch.zeros_like(values)
    for i in range(values.size(0)):
        idx = mask[i].nonzero().flatten()
        if idx.numel() == 0:
            continue
        v = values[i, idx]
        nxt = torch.cat([v[1:], v.new_zeros(1)])
        r = torch.zeros_like(v)
        r[-1] = rewards[i]
        delta = r + gamma * nxt - v
        n = v.numel()
        # A_t = sum_k (gamma lam)^(k-t) delta_k, as one upper-triangular matrix product
        k = torch.arange(n, device=v.device)
        expo = (k[None, :] - k[:, None]).clamp(min=0).to(v.dtype)
        disc = torch.triu((gamma * lam) ** expo)
        adv[i, idx] = disc @ delta
    return adv, adv + values


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, n_tokens: float | None = None,
              n_rows: float | None = None) -> torch.Tensor:
    """`token`: mean over all generated tokens of the batch (long answers weigh more, as in DAPO);
    `sequence`: mean within each sample, then over samples (GRPO's original form). `n_tokens` / `n_rows`
    override the denominators when rows that carry no gradient were left out of the batch."""
    if how == "token":
        return (per_token * mask).sum() / (n_tokens or mask.sum().clamp(min=1))
    n = mask.sum(1)
    rows = n > 0
    return ((per_token * mask).sum(1)[rows] / n[rows]).sum() / (n_rows or rows.sum().clamp(min=1))


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                clip_eps: float, is_lower: float, is_upper: float, agg: str = "token",
                n_tokens: float | None = None, n_rows: float | None = None, stats: bool = True
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip against the behaviour policy (the rollout's own logprobs: no old-policy recompute), with
    double-sided importance-sampling masking: a token whose ratio leaves [is_lower, is_upper] gets no
    gradient at all (clipping alone would still pass it the unclipped side's gradient). A sum of per-token
    terms (TrainEngine.logprob_loss's contract). `stats=False`: the loss alone, no host sync."""
    log_ratio = (logp - behaviour_logp) * mask
    ratio = log_ratio.exp()
    keep = mask * ((ratio >= is_lower) & (ratio <= is_upper)).float()
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    pg = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    # masked tokens still count in the denominator: they lose their weight, the others keep theirs
    loss = aggregate(pg * keep, mask, agg, n_tokens, n_rows)
    if not stats:
        return loss, {}
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "masked_fraction": ((mask - keep).sum() / n).item(),
            "clip_frac": ((((ratio - 1).abs() > clip_eps).float() * keep).sum() / n).item(),
            "ratio_mean": ((ratio * mask).sum() / n).item(),
            # mean |log pi_train - log pi_rollout| over the generated tokens: how far trainer and rollout disagree
            "logratio_abs": (log_ratio.abs().sum() / n).item(),
            # k3 estimator of KL(behaviour || current) on the behaviour policy's own samples, >= 0
            "kl_behaviour": (((ratio - 1) - log_ratio) * mask).sum().div(n).item(),
        }
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, n_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss: the worse of the unclipped and the clipped-to-old prediction. The clip
    binds only once the critic has moved since `old_values` were taken (a second `rl.ppo_epochs` pass)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_err, clipped_err = (values - returns) ** 2, (clipped - returns) ** 2
    err = torch.maximum(unclipped_err, clipped_err)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {"value_clip_frac": (((clipped_err > unclipped_err).float() * mask).sum() / n).item()}
    return 0.5 * (err * mask).sum() / (n_tokens or mask.sum().clamp(min=1)), stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 one that predicts only the mean,
    below 0 worse than that (NaN when the returns do not vary)."""
    var = returns.var(unbiased=False)
    return float("nan") if var == 0 else (1 - (returns - values).var(unbiased=False) / var).item()


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of a per-token quantity (the policy's entropy) over the generated positions."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(current || reference) on the sampled tokens (unbiased, >= 0 per token)."""
    d = (ref_logp - logp) * mask
    return ((d.exp() - d - 1) * mask).sum() / mask.sum().clamp(min=1)
