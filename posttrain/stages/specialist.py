"""rl-<domain> node: one specialist per domain of rl.domains, trained by the RL loop (posttrain/rl/loop.py)
with the domain's verifier as reward."""
from __future__ import annotations

import json
from pathlib import Path

import environments
from posttrain.config import PipelineConfig
from posttrain.data import load_tasks
from posttrain.engines import lora_options, rollout_options, train_options
from posttrain.judge import ModelJudge, measure
from posttrain.models import moe
from posttrain.models.preset import save_checkpoint
from posttrain.pipeline.console import kv
from posttrain.rl import alarms
from posttrain.rl.loop import kept_metrics, train_policy
from posttrain.train import moe_metrics, summarize


def plot_curves(hist: dict, path: Path, title: str, kept: tuple[int, float] | None = None) -> None:
    import matplotlib  # heavy, for this figure only; its backend is set before pyplot is imported
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    gap = "logratio_abs" in hist
    fig, axes = plt.subplots(1, 2 if gap else 1, figsize=(11 if gap else 6, 3.5), squeeze=False)
    ax = axes[0, 0]
    ax.plot(range(1, len(hist["reward"]) + 1), hist["reward"], label="reward (train batch)", alpha=0.6)
    ax.plot(*zip(*hist["val_score"]), "o-", label="validation accuracy (greedy)")
    if kept and kept[0] != hist["val_score"][-1][0]:  # rl.keep best wrote an earlier step's weights
        ax.axvline(kept[0], color="gray", ls=":", label=f"kept: step {kept[0]}")
    ax.set(xlabel="step", ylabel="score", title=title, ylim=(0, 1.02))
    ax.legend(loc="lower right")
    if gap:  # where the train engine and the rollout engine disagree on the sampled tokens
        steps = range(1, len(hist["logratio_abs"]) + 1)
        b = axes[0, 1]
        b.plot(steps, hist["logratio_abs"], color="C2", label="mean |log pi_train - log pi_rollout|")
        b.set(xlabel="step", ylabel="per generated token", title="train / rollout mismatch")
        m = b.twinx()
        m.plot(steps, hist["masked_fraction"], color="C3", ls="--", label="share masked by IS")
        if "mixed_version_share" in hist:  # partial rollouts: samples whose tokens span a weight update
            m.plot(steps, hist["mixed_version_share"], color="C4", ls=":", label="share spanning an update")
        m.set_ylabel("share of tokens")
        b.legend(loc="upper left")
        m.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def checked_judge(cfg: PipelineConfig, inputs: dict[str, str], out: Path, domain: str) -> tuple[str, dict]:
    """The guard's model judge for this specialist (rl.judge), measured on the environment's labelled calls
    (judge.json); a judge below the floors stops the stage. ("", {}) without a judge: the rules-only guard."""
    j = cfg.rl.for_domain(domain).judge
    if not j.checkpoint:
        return "", {}
    env = environments.get(domain)
    if not hasattr(env, "judge_cases"):
        raise ValueError(f"rl.judge: environment {domain} has no labelled calls (judge_cases) to measure a judge on; "
                         f"set rl.per_domain.{domain}.judge.checkpoint to \"\" for the rules-only guard")
    path = inputs["sft"] if j.checkpoint == "sft" else j.checkpoint
    judged = measure(ModelJudge(path, tuple(j.features), cfg.runtime.rollout_engine),
                     env.judge_cases("test", j.labelled_per_class, cfg.world.seed))
    (out / "judge.json").write_text(json.dumps({"checkpoint": j.checkpoint, **judged}, indent=1))
    print(f"[rl-{domain}] judge {j.checkpoint}: {kv(judged)}", flush=True)
    if judged["precision"] < j.min_precision or judged["recall"] < j.min_recall:
        raise RuntimeError(
            f"rl-{domain}: the guard's judge ({j.checkpoint}: {path}) blocks with precision {judged['precision']} "
            f"and recall {judged['recall']} on {judged['labelled_calls']} labelled calls (floors "
            f"rl.judge.min_precision {j.min_precision}, min_recall {j.min_recall}): it would block honest calls or let "
            f"hacks through. Train it "
            f"(world.agentic_judge_share > 0 puts the judge's questions in the sft data), name another checkpoint, or "
            f"leave rl.judge.checkpoint empty for the rules-only guard")
    return path, judged


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, domain: str, scratch: str = "") -> dict:
    r = cfg.rl.for_domain(domain)
    pool = load_tasks(inputs["curate"], "rl", domain)
    val = load_tasks(inputs["curate"], "val", domain)
    judge, judged = checked_judge(cfg, inputs, out, domain)
    policy, tok, st = train_policy(r, inputs["sft"], pool, val, seed=cfg.seed, label=f"rl-{domain}", moe=cfg.moe,
                                 scratch=scratch, judge=judge,
                                 engine=(cfg.runtime.train_engine, train_options(cfg) | lora_options(cfg, "rl")),
                                 **rollout_options(cfg))
    save_checkpoint(policy, tok, out)
    hist = st.history
    # blocked hack attempts, with the call and the guard stage that caught it, for reviewers
    (out / "hack_attempts.json").write_text(json.dumps(st.attempts[:500], indent=1))
    (out / "history.json").write_text(json.dumps(hist))
    moe.plot_load(hist, out / moe.PLOT, f"rl-{domain}")
    plot_curves(hist, out / "rl_curves.png", f"rl {domain} ({r.algorithm}, k={r.max_staleness}, "
                f"{cfg.runtime.train_engine} / {cfg.runtime.rollout_engine})", st.kept)
    total = sum(st.staleness.values())
    metrics = {"val_score_before": hist["val_score"][0][1], "val_score_after": hist["val_score"][-1][1],
               **kept_metrics(st),
               **summarize(hist, "reward", 5), **moe_metrics(hist, 5), "hack_attempts_blocked": sum(hist["blocked"]),
               "masked_token_fraction": sum(hist["masked_fraction"]) / len(hist["masked_fraction"]),
               "stale_dropped": st.dropped, "wall_s": st.wall_s, "steps_per_s": r.steps / st.wall_s,
               "student_tokens": hist["student_tokens"][-1],
               **{f"staleness_{k}_share": v / total for k, v in sorted(st.staleness.items())}}
    for key in ("replay_probe_with", "replay_probe_without"):  # routing replay's effect, every step (rl.step)
        if xs := [x for x in hist.get(key, []) if x == x]:
            metrics[key] = sum(xs) / len(xs)
    if judge:
        per_episode = [x for x in hist["judge_tokens_per_episode"] if x == x]
        metrics |= {f"judge.{k}": v for k, v in judged.items() if isinstance(v, (int, float))}
        metrics["judge.judge_tokens_per_episode"] = sum(per_episode) / max(1, len(per_episode))
        metrics["judge.blocked"] = sum(a["stage"] == "judge" for a in st.attempts)
    if r.context_budget:
        metrics["subtraces_per_episode"] = sum(hist["subtraces_per_episode"]) / len(hist["subtraces_per_episode"])
        metrics["truncated_share"] = sum(hist["truncated_share"]) / len(hist["truncated_share"])
    found = alarms.publish(st.alarms, out, f"rl-{domain}", hist)  # reward-hacking alarms, tagged on the MLflow run
    return {"metrics": {**metrics, **found["metrics"]}, "tags": found["tags"], "history": hist,
            "params": {"domain": domain, "algorithm": r.algorithm, "max_staleness": r.max_staleness}}
