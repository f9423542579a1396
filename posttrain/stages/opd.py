"""opd: multi-teacher on-policy distillation. The student (the sft checkpoint) samples prompts mixed across
the domains of rl.domains; the specialist of each prompt's domain, a Ray actor, scores the student's own tokens; the
per-token reverse KL is the signal (posttrain/rl/opd_loss.py). The loop is the RL loop (posttrain/rl/loop.py):
asynchronous rollout workers, token in token out, importance-sampling masks, exact resume."""
from __future__ import annotations

import json
from pathlib import Path

from environments import everyday
from posttrain.config import PipelineConfig, RLConfig
from posttrain.data import load_tasks
from posttrain.engines import lora_options, rollout_options, train_options
from posttrain.merge import average_with_base
from posttrain.models import moe
from posttrain.models.preset import save_checkpoint
from posttrain.pipeline.artifacts import read_manifest
from posttrain.replay import PROMPTS
from posttrain.rl.loop import Distill, kept_metrics, train_policy
from posttrain.train import moe_metrics, summarize


def loop_config(cfg: PipelineConfig) -> RLConfig:
    """The RL loop's settings for distillation alone (no RL batch; opd.kl_coef the reference KL's weight)."""
    o = cfg.opd
    return cfg.rl.model_copy(update=dict(
        steps=o.steps, prompts_per_step=0, lr=o.lr, temperature=o.temperature, max_new_tokens=o.max_new_tokens,
        max_staleness=o.max_staleness, val_every=o.val_every, keep=o.keep, checkpoint_every=o.checkpoint_every,
        kl_coef=o.kl_coef, entropy_coef=0.0, ppo_epochs=1, per_domain={}))


def teacher_score(metrics: dict) -> float:
    """A specialist's validation score as written: the kept step's under rl.keep best, else the last step's."""
    return metrics.get("val_score_kept", metrics["val_score_after"])


def tokens_to_reach(hist: dict, key: str, target: float) -> float | None:
    """Student tokens generated when the validation curve `key` first reached `target` (None: never)."""
    tokens = [0.0] + hist["student_tokens"]
    for step, score in hist[key]:
        if score >= target - 1e-9:
            return tokens[step]
    return None


def plot(hist: dict, targets: dict[str, float], path: Path) -> None:
    import matplotlib  # heavy, for this figure only; its backend is set before pyplot is imported
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    tokens = [0.0] + hist["student_tokens"]
    for i, (d, target) in enumerate(sorted(targets.items())):
        steps, scores = zip(*hist[f"val_score/{d}"])
        a.plot([tokens[s] for s in steps], scores, "o-", color=f"C{i}", label=d)
        a.axhline(target, color=f"C{i}", ls="--", lw=0.8)
        b.plot(range(1, len(hist[f"reverse_kl/{d}"]) + 1), hist[f"reverse_kl/{d}"], color=f"C{i}", alpha=0.8,
               label=d)
    a.set(xlabel="student tokens generated", ylabel="validation accuracy (greedy)", ylim=(0, 1.02),
          title="generalist vs its teachers (dashed)")
    b.set(xlabel="step", ylabel="reverse KL per token", title="distance to the teacher")
    a.legend(loc="lower right")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, scratch: str = "") -> dict:
    o, domains = cfg.opd, cfg.rl.domains
    pool = [t for d in domains for t in load_tasks(inputs["curate"], "rl", d)]
    val = [t for d in domains for t in load_tasks(inputs["curate"], "val", d)]
    teachers, route = {d: inputs[f"rl-{d}"] for d in domains}, dict(o.route)
    if o.base_teaches():  # the base model as one more teacher: its everyday answers and the domains routed to it
        teachers["base"] = inputs["base"]
        if o.everyday_prompts:
            pool += everyday.tasks(list(PROMPTS[:o.everyday_prompts]))
            route[everyday.DOMAIN] = "base"
    distill = Distill(teachers, pool, o.prompts_per_step, route=route,
                      mode=o.loss, top_k=o.top_k, reward_weight=o.reward_weight, kl_coef=o.kl_coef,
                      teacher_cpus=o.teacher_cpus,
                      teacher_placement=o.teacher_placement)
    policy, tok, st = train_policy(loop_config(cfg), inputs[o.student], [], val, seed=cfg.seed, label="opd", moe=cfg.moe,
                                 scratch=scratch, distill=distill,
                                 engine=(cfg.runtime.train_engine, train_options(cfg) | lora_options(cfg, "opd")),
                                 **rollout_options(cfg))
    save_checkpoint(policy, tok, out)
    averaged = average_with_base(out, inputs["base"], o.base_weight) if o.base_weight else {}
    hist = st.history
    (out / "history.json").write_text(json.dumps(hist))
    moe.plot_load(hist, out / moe.PLOT, "opd")
    # the teachers' own validation scores (same val tasks, from their runs): how far the student got
    teacher_val = {d: teacher_score(read_manifest(inputs[f"rl-{d}"])["metrics"]) for d in domains}
    plot(hist, teacher_val, out / "opd_curves.png")
    metrics = {"wall_s": st.wall_s, "steps_per_s": o.steps / st.wall_s,
               "student_tokens": hist["student_tokens"][-1], "teacher_tokens": hist["teacher_tokens"][-1],
               **summarize(hist, "reverse_kl", 5), **moe_metrics(hist, 5),
               "masked_token_fraction": sum(hist["distill_masked_fraction"]) / o.steps, **kept_metrics(st),
               **({"base_weight": o.base_weight, "tensors_averaged": averaged["averaged"]} if averaged else {})}
    for d in domains:
        before, after = hist[f"val_score/{d}"][0][1], hist[f"val_score/{d}"][-1][1]
        metrics |= {f"val_score_before_{d}": before, f"val_score_after_{d}": after,
                    f"teacher_val_score_{d}": teacher_val[d]}
        reached = tokens_to_reach(hist, f"val_score/{d}", 0.95 * teacher_val[d])
        if reached is not None:
            metrics[f"student_tokens_to_95pct_{d}"] = reached
    return {"metrics": metrics, "history": hist, "params": {"loss": o.loss, "student": o.student,
                                                            "teachers": ",".join(sorted(teachers))}}
