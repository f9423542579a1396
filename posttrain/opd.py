"""opd: multi-teacher on-policy distillation. The student samples; the specialist for each prompt's
domain scores the student's own tokens; the loss is the per-token reverse KL(student || teacher)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from environments import DOMAINS
from posttrain.config import PipelineConfig
from posttrain.curate import load_tasks
from posttrain.model import load_checkpoint, save_checkpoint, seed_all
from posttrain.rollout import episode_batch, mean_score, run_episodes, score, token_logits
from posttrain.train import make_optimizer, summarize


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of sum_v p_s(v) (log p_s(v) - log p_t(v))."""
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    o = cfg.opd
    student, tok = load_checkpoint(inputs["sft"])
    teachers = {d: load_checkpoint(inputs[f"rl-{d}"])[0].eval() for d in DOMAINS}
    pools = {d: load_tasks(inputs["curate"], "rl", d) for d in DOMAINS}
    vals = {d: load_tasks(inputs["curate"], "val", d) for d in DOMAINS}
    kw = dict(max_new_tokens=o.max_new_tokens, max_turns=cfg.rl.max_turns)
    before = {d: mean_score(student, tok, vals[d], **kw) for d in DOMAINS}
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = make_optimizer(student, o.lr)
    hist: dict[str, list[float]] = {f"{k}_{d}": [] for d in DOMAINS for k in ("kl", "reward")}
    hist["kl"] = []
    per_domain = max(1, o.prompts_per_step // len(DOMAINS))
    for step in range(o.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for d in DOMAINS:
            student.eval()
            eps = run_episodes(student, tok, rng.sample(pools[d], per_domain), temperature=o.temperature,
                               generator=gen, **kw)
            batch = episode_batch(eps, tok.pad_token_id)
            with torch.no_grad():
                t_logits = token_logits(teachers[d], batch)
            student.train()
            loss = reverse_kl(token_logits(student, batch), t_logits, batch["mask"]) / len(DOMAINS)
            loss.backward()
            total += loss.item()
            hist[f"kl_{d}"].append(loss.item() * len(DOMAINS))
            hist[f"reward_{d}"].append(sum(score(eps)) / len(eps))
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        hist["kl"].append(total)
        print(f"[opd] step {step + 1}/{o.steps} reverse KL {total:.4f}", flush=True)
    student.eval()
    after = {d: mean_score(student, tok, vals[d], **kw) for d in DOMAINS}
    save_checkpoint(student, tok, out)
    metrics = {**summarize(hist, "kl", 5), **{f"val_score_before_{d}": v for d, v in before.items()},
               **{f"val_score_after_{d}": v for d, v in after.items()}}
    return {"metrics": metrics, "history": hist}
