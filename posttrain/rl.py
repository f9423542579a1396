"""rl: one specialist per domain, GRPO with the domain's verifier as reward.

The trainer consumes the exact token ids and logprobs the rollout produced (TITO), so the
importance ratio measures only the policy change, never a re-tokenisation drift.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from posttrain.config import PipelineConfig
from posttrain.curate import load_tasks
from posttrain.model import load_checkpoint, save_checkpoint, seed_all
from posttrain.rollout import episode_batch, mean_score, run_episodes, score, token_logits
from posttrain.train import make_optimizer, summarize


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: reward minus its group mean, over the group std (zero for groups with one outcome)."""
    g = rewards.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()


def clipped_pg_loss(logits: torch.Tensor, batch: dict, adv: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict]:
    target = batch["input_ids"][:, 1:]
    logp = torch.log_softmax(logits, -1).gather(-1, target[..., None]).squeeze(-1)
    mask = batch["mask"]
    ratio = torch.exp(logp - batch["old_logprobs"]) * mask + (1 - mask)
    a = adv[:, None]
    pg = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    loss = (pg * mask).sum() / mask.sum().clamp(min=1)
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float().mul(mask).sum() / mask.sum().clamp(min=1)
    return loss, {"clip_frac": clipped.item(), "ratio_mean": ((ratio * mask).sum() / mask.sum()).item()}


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, domain: str) -> dict:
    seed_all(cfg.seed)
    r = cfg.rl
    model, tok = load_checkpoint(inputs["sft"])
    pool = load_tasks(inputs["curate"], "rl", domain)
    val = load_tasks(inputs["curate"], "val", domain)
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = make_optimizer(model, r.lr)
    kw = dict(max_new_tokens=r.max_new_tokens, max_turns=r.max_turns)
    val_before = mean_score(model, tok, val, **kw)
    hist: dict[str, list[float]] = {k: [] for k in ("reward", "loss", "clip_frac", "ratio_mean", "gen_tokens", "blocked")}
    attempts: list[dict] = []
    for step in range(r.steps):
        tasks = [t for t in rng.sample(pool, r.prompts_per_step) for _ in range(r.group_size)]
        model.eval()
        eps = run_episodes(model, tok, tasks, temperature=r.temperature, generator=gen, **kw)
        rewards = torch.tensor(score(eps))
        adv = group_advantages(rewards, r.group_size)
        model.train()
        batch = episode_batch(eps, tok.pad_token_id)
        loss, stats = clipped_pg_loss(token_logits(model, batch), batch, adv, r.clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        attempts += [{"step": step, "task": e.task.id, **b} for e in eps for b in e.blocked]
        for k, v in {"reward": rewards.mean().item(), "loss": loss.item(), **stats,
                     "gen_tokens": sum(e.n_generated for e in eps) / len(eps),
                     "blocked": float(sum(len(e.blocked) for e in eps))}.items():
            hist[k].append(v)
        print(f"[rl-{domain}] step {step + 1}/{r.steps} reward {rewards.mean():.3f} loss {loss.item():.4f}", flush=True)
    model.eval()
    val_after = mean_score(model, tok, val, **kw)
    save_checkpoint(model, tok, out)
    # blocked hack attempts, with the call and the guard stage that caught it, for reviewers
    (out / "hack_attempts.json").write_text(json.dumps(attempts[:500], indent=1))
    metrics = {"val_score_before": val_before, "val_score_after": val_after, **summarize(hist, "reward", 5),
               "hack_attempts_blocked": sum(hist["blocked"])}
    return {"metrics": metrics, "history": hist, "params": {"domain": domain}}
