"""rl-<domain> node: one specialist per domain of rl.domains, trained by the RL loop (posttrain/rl/loop.py)
with the domain's verifier as reward."""
from __future__ import annotations

import json
from pathlib import Path

from posttrain.config import PipelineConfig
from posttrain.data import load_tasks
from posttrain.model import save_checkpoint
from posttrain.rl import alarms
from posttrain.rl.loop import train_policy
from posttrain.train import summarize


def plot_curves(hist: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(hist["reward"]) + 1), hist["reward"], label="reward (train batch)", alpha=0.6)
    ax.plot(*zip(*hist["val_score"]), "o-", label="validation accuracy (greedy)")
    ax.set(xlabel="step", ylabel="score", title=title, ylim=(0, 1.02))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, domain: str, scratch: str = "") -> dict:
    r = cfg.rl.for_domain(domain)
    pool = load_tasks(inputs["curate"], "rl", domain)
    val = load_tasks(inputs["curate"], "val", domain)
    policy, tok, st = train_policy(r, inputs["sft"], pool, val, seed=cfg.seed, label=f"rl-{domain}",
                                 scratch=scratch)
    save_checkpoint(policy, tok, out)
    hist = st.history
    # blocked hack attempts, with the call and the guard stage that caught it, for reviewers
    (out / "hack_attempts.json").write_text(json.dumps(st.attempts[:500], indent=1))
    (out / "history.json").write_text(json.dumps(hist))
    plot_curves(hist, out / "rl_curves.png", f"rl {domain} ({r.algorithm}, k={r.max_staleness})")
    total = sum(st.staleness.values())
    metrics = {"val_score_before": hist["val_score"][0][1], "val_score_after": hist["val_score"][-1][1],
               **summarize(hist, "reward", 5), "hack_attempts_blocked": sum(hist["blocked"]),
               "masked_token_fraction": sum(hist["masked_fraction"]) / len(hist["masked_fraction"]),
               "stale_dropped": st.dropped, "wall_s": st.wall_s, "steps_per_s": r.steps / st.wall_s,
               "student_tokens": hist["student_tokens"][-1],
               **{f"staleness_{k}_share": v / total for k, v in sorted(st.staleness.items())}}
    found = alarms.publish(st.alarms, out)  # reward-hacking alarms, tagged on the MLflow run
    return {"metrics": {**metrics, **found["metrics"]}, "tags": found["tags"], "history": hist,
            "params": {"domain": domain, "algorithm": r.algorithm, "max_staleness": r.max_staleness}}
