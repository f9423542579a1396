"""One policy update (and the critic's, for PPO) from a batch of rollout samples: GRPO or critic PPO with
double-sided importance-sampling masks, an optional reference KL, and another loss's gradient (distillation)
accumulated into the same optimizer step."""
from __future__ import annotations

import torch

from posttrain.config import RLConfig
from posttrain.engines import TrainEngine
from posttrain.models.prefix import micro_batches
from posttrain.rl.batches import completion_batch
from posttrain.rl.losses import (explained_variance, gae, group_advantages, kl_to_reference, policy_loss, token_mean,
                                 value_loss)
from posttrain.rl.workers import Sample


def train_step(r: RLConfig, policy: TrainEngine, samples: list[Sample], critic: TrainEngine | None = None,
               ref: TrainEngine | None = None, extra=None) -> dict[str, float]:
    """One update from a batch of samples (whole groups, in order); returns the step's statistics.
    `extra()`, if given, accumulates another loss's gradient (distillation) into the same update.

    The batch runs as length-sorted micro-batches whose losses are normalised by the whole batch's token
    and row counts, so their accumulated gradient is the full batch's."""
    if not samples:  # distillation only
        policy.zero_grad()
        stats = extra() if extra else {}
        stats["grad_norm"] = policy.step(1.0)
        return stats | policy.step_stats()
    if critic is None and any(s.subtrace for s in samples):
        raise ValueError("GRPO got compacted sub-traces: its group comparison needs whole episodes (rl.algorithm: ppo)")
    dev = policy.device
    rewards = torch.tensor([s.reward for s in samples], device=dev)
    n_tokens = float(sum(s.n_generated for s in samples))
    norm = {"n_tokens": n_tokens, "n_rows": float(sum(s.n_generated > 0 for s in samples))}
    if critic is None:
        adv = group_advantages(rewards, r.group_size)
        live = adv != 0
        if r.kl_coef or r.entropy_coef:
            live[:] = True  # their terms need every row
        # a group whose samples all scored the same has zero advantage and no gradient: it skips the forward
        live[0] = True  # keep one row: an all-zero batch still takes its (zero-gradient) optimizer step
        samples, adv, rewards = [s for s, k in zip(samples, live.tolist()) if k], adv[live], rewards[live]
    chunks = [(idx, [samples[i] for i in idx]) for idx in micro_batches(samples, r.micro_batch_cells)]
    batches = [completion_batch(sub, dev) for _, sub in chunks]
    trained = sum(b["mask"].sum().item() for b in batches)
    if critic is None:
        advs = [adv[idx] for idx, _ in chunks]
    else:
        # the first pass's critic forward is the one the advantages need (nothing has updated the critic yet):
        # its detached values are the old values, so a step runs one critic forward fewer
        first, old_vs, returns, gaes = critic_pass(r, critic, chunks, batches, n_tokens, trained, rewards=rewards)
        flat = torch.cat([a[b["mask"] > 0] for a, b in zip(gaes, batches)])  # whitened over the whole batch
        advs = [(a - flat.mean()) / (flat.std() + 1e-6) * b["mask"] for a, b in zip(gaes, batches)]

    def loss_for(b: dict, a: torch.Tensor, ref_logp: torch.Tensor | None):
        """A micro-batch's loss: per-token terms only (the engine may differentiate it chunk by chunk)."""
        mask = b["mask"]
        share = mask.sum().item() / n_tokens  # this micro-batch's part of a token mean over the batch

        def loss_of(logp, ent, stats=False):
            loss, st = policy_loss(logp, b["old_logprobs"], a, mask, clip_eps=r.clip_eps, is_lower=r.is_lower,
                                   is_upper=r.is_upper, agg=r.loss_agg, stats=stats, **norm)
            if r.entropy_coef:
                loss = loss - r.entropy_coef * token_mean(ent, mask) * share
            if r.kl_coef and ref_logp is not None:
                loss = loss + r.kl_coef * kl_to_reference(logp, ref_logp, mask) * share
            return (loss, st) if stats else loss
        return loss_of

    refs = [None] * len(chunks)
    if ref is not None:  # in the loss where kl_coef > 0; else watched only (posttrain.rl.alarms). Frozen: once a step
        with torch.no_grad():
            refs = [ref.logprobs(sub, r.temperature)[0] for _, sub in chunks]
    losses = [loss_for(b, a, ref_logp) for b, a, ref_logp in zip(batches, advs, refs)]
    stats: dict[str, float] = {}
    probe: dict[str, float] = {}
    for epoch in range(r.ppo_epochs):
        stats = {}
        policy.zero_grad()
        # at the sampling temperature, as the behaviour's; every micro-batch backpropagated (megatron: in the 1F1B
        # order over pipeline stages), the gradient made in the forward where the engine can
        done = policy.logprob_losses([(sub, loss_of) for (_, sub), loss_of in zip(chunks, losses)], r.temperature)
        for b, loss_of, ref_logp, (loss, logp, ent_tok) in zip(batches, losses, refs, done):
            mask = b["mask"]
            with torch.no_grad():
                st = loss_of(logp, ent_tok, stats=True)[1]
                st["entropy"] = token_mean(ent_tok, mask).item()
                if ref_logp is not None:
                    st["kl_ref"] = kl_to_reference(logp, ref_logp, mask).item()
            stats["loss"] = stats.get("loss", 0.0) + loss.item()
            for k, v in st.items():  # token means, weighted by the micro-batch's tokens among the trained ones
                stats[k] = stats.get(k, 0.0) + v * mask.sum().item() / trained
        if epoch == 0 and getattr(policy, "routing_replay", False) and hasattr(policy, "unreplayed_logprobs"):
            probe = replay_probe(policy, chunks[0][1], batches[0], done[0][1], r.temperature)
        if extra:
            stats.update(extra())
        stats["grad_norm"] = policy.step(1.0)
        stats |= policy.step_stats()
        if critic is not None:
            stats |= first if epoch == 0 else critic_pass(r, critic, chunks, batches, n_tokens, trained,
                                                           old_values=old_vs, returns=returns)[0]
            stats["critic_grad_norm"] = critic.step(1.0)
    return stats | probe


def replay_probe(policy: TrainEngine, samples: list[Sample], b: dict, replayed: torch.Tensor, temperature: float
                 ) -> dict[str, float]:
    """What routing replay buys on this micro-batch, before the update: the mean |log pi_train - log pi_rollout|
    over its generated tokens with the rollout's experts replayed (the trained forward's) and with the trainer's
    router choosing (one more forward, no grad)."""
    mask, old = b["mask"], b["old_logprobs"]
    n = mask.sum().clamp(min=1)
    free = policy.unreplayed_logprobs(samples, temperature)[0]
    return {"replay_probe_with": (((replayed - old) * mask).abs().sum() / n).item(),
            "replay_probe_without": (((free - old) * mask).abs().sum() / n).item()}


def critic_pass(r: RLConfig, critic: TrainEngine, chunks: list, batches: list[dict], n_tokens: float, trained: float,
                rewards: torch.Tensor | None = None, old_values: list | None = None, returns: list | None = None
                ) -> tuple[dict, list, list, list]:
    """The critic's clipped value loss, backward over the batch's micro-batches (its optimizer step is the
    caller's): (statistics, values, returns, GAE advantages). Without `old_values` (the first pass) the values it
    computes are the old values, and the returns and advantages come from them and `rewards`."""
    critic.zero_grad()
    first = old_values is None
    stats = {"value_loss": 0.0, "value_clip_frac": 0.0}
    values, advantages, returns = [], [], [] if first else returns
    for i, ((idx, sub), b) in enumerate(zip(chunks, batches)):
        v = critic.forward(sub)
        values.append(v.detach())
        if first:
            a, ret = gae(values[i], rewards[idx], b["mask"], r.gae_gamma, r.gae_lambda)
            advantages.append(a)
            returns.append(ret)
        vl, vst = value_loss(v, values[i] if first else old_values[i], returns[i], b["mask"], r.value_clip, n_tokens)
        critic.backward(vl)
        stats["value_loss"] += vl.item()
        stats["value_clip_frac"] += vst["value_clip_frac"] * b["mask"].sum().item() / trained
    # of the values this pass trained on (before its update), over the whole batch
    stats["explained_variance"] = explained_variance(torch.cat([v[b["mask"] > 0] for v, b in zip(values, batches)]),
                                                     torch.cat([x[b["mask"] > 0] for x, b in zip(returns, batches)]))
    return stats, values, returns, advantages
