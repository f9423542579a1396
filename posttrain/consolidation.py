"""consolidation: the comparison of three ways to end with one model that keeps every specialist's gain:
multi-teacher OPD (the GLM-5.2 recipe), cross-stage distillation and plain sequential RL (the GLM-5
recipe and its baseline, workflows/cross_stage.py). Per domain: test score, recovery of the specialist's
gain over sft, forgetting; per method: compute (student tokens generated, teacher tokens scored, wall)."""
from __future__ import annotations

import json
from pathlib import Path

from environments import DOMAINS
from posttrain.artifacts import read_manifest
from posttrain.config import PipelineConfig
from posttrain.curate import load_tasks
from posttrain.evaluate import evaluate_checkpoint
from posttrain.opd import tokens_to_reach
from posttrain.stages import CROSS_ORDER as ORDER, stage_name

METHODS = {"multi_teacher_opd": "opd", "cross_stage": stage_name("xs", ORDER[-1]),
           "sequential_rl": stage_name("seq", ORDER[-1])}


def test_scores(path: str, tests: dict[str, list], cfg: PipelineConfig) -> dict[str, float]:
    """Greedy score per domain, thinking on, through the evaluate stage's own scorer."""
    return evaluate_checkpoint(cfg, path, {d: (tasks, True) for d, tasks in tests.items()})[0]


def compute_of(inputs: dict[str, str], stages: list[str]) -> dict[str, float]:
    m = [read_manifest(inputs[s])["metrics"] for s in stages]
    return {k: round(sum(x.get(k, 0.0) for x in m), 2) for k in ("student_tokens", "teacher_tokens", "wall_s")}


def rl_tokens_to_95pct(rl_dir: str) -> float | None:
    """Student tokens the RL specialist generated until its validation score first reached 95% of its final."""
    hist = json.loads((Path(rl_dir) / "history.json").read_text())
    return tokens_to_reach(hist, "val_score", 0.95 * hist["val_score"][-1][1])


def table(c: dict) -> str:
    rows = ["| model | " + " | ".join(f"{d} (recovery)" for d in DOMAINS) + " | student tokens | teacher tokens |"
            " wall s |", "|---" * (len(DOMAINS) + 4) + "|"]
    for name in ("sft", "specialist", *METHODS, "sequential_after_agentic", "cross_stage_after_agentic"):
        s, rec, comp = c["scores"][name], c["recovery"].get(name, {}), c["compute"].get(name, {})
        cells = [f"{s[d]:.2f}" + (f" ({rec[d]:.0%})" if rec.get(d) is not None else "") for d in DOMAINS]
        extra = [f"{comp[k]:,.0f}" if comp else "" for k in ("student_tokens", "teacher_tokens", "wall_s")]
        rows.append(f"| {name} | " + " | ".join(cells + extra) + " |")
    return "\n".join(rows)


def plot(c: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["sft", "specialist", *METHODS]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + i * w for j in range(len(DOMAINS))], [c["scores"][n][d] for d in DOMAINS], w, label=n)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(DOMAINS))], DOMAINS)
    ax.set(ylabel="test score (greedy)", ylim=(0, 1.2), title="one model from three specialists")
    ax.legend(fontsize=7, ncol=len(names), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    n = cfg.cross_stage.eval_n or None
    tests = {d: load_tasks(inputs["curate"], "test", d)[:n] for d in DOMAINS}
    scores = {"sft": test_scores(inputs["sft"], tests, cfg)}
    specialists = {d: test_scores(inputs[f"rl-{d}"], tests, cfg) for d in DOMAINS}
    scores["specialist"] = {d: specialists[d][d] for d in DOMAINS}  # each on its own domain
    for name, stage in {**METHODS, "sequential_after_agentic": "seq-agentic",
                        "cross_stage_after_agentic": "xs-agentic"}.items():
        scores[name] = test_scores(inputs[stage], tests, cfg)
        print(f"[consolidation] {name}: {scores[name]}", flush=True)
    sft, spec = scores["sft"], scores["specialist"]
    recovery = {name: {d: round((scores[name][d] - sft[d]) / (spec[d] - sft[d]), 3) if spec[d] != sft[d] else None
                       for d in DOMAINS} for name in METHODS}
    # forgetting: a domain's score right after its own stage minus its score at the end of the chain
    after_own = {"sequential_rl": {"reasoning": specialists["reasoning"]["reasoning"],
                                   "agentic": scores["sequential_after_agentic"]["agentic"]},
                 "cross_stage": {"reasoning": specialists["reasoning"]["reasoning"],
                                 "agentic": scores["cross_stage_after_agentic"]["agentic"]}}
    forgetting = {m: {d: round(v - scores[m][d], 4) for d, v in own.items()} for m, own in after_own.items()}
    chain = {m: [stage_name(c, d) for d in ORDER] for m, c in (("sequential_rl", "seq"), ("cross_stage", "xs"))}
    compute = {"multi_teacher_opd": compute_of(inputs, ["opd"]),
               "multi_teacher_opd_incl_specialists": compute_of(inputs, ["opd", *(f"rl-{d}" for d in DOMAINS)]),
               "cross_stage": compute_of(inputs, chain["cross_stage"]),
               "sequential_rl": compute_of(inputs, chain["sequential_rl"])}
    opd_m = read_manifest(inputs["opd"])["metrics"]
    efficiency = {}
    for d in DOMAINS:
        rl_t, opd_t = rl_tokens_to_95pct(inputs[f"rl-{d}"]), opd_m.get(f"student_tokens_to_95pct_{d}")
        efficiency[d] = {"rl_student_tokens_to_95pct": rl_t, "opd_student_tokens_to_95pct": opd_t,
                         "token_efficiency_ratio": round(rl_t / opd_t, 2) if rl_t and opd_t else None}
    c = {"n_test_per_domain": {d: len(t) for d, t in tests.items()}, "scores": scores, "recovery": recovery,
         "forgetting": forgetting, "compute": compute, "token_efficiency": efficiency}
    (out / "consolidation.json").write_text(json.dumps({"consolidation": c}, indent=1))
    (out / "consolidation.md").write_text(table(c) + "\n")
    plot(c, out / "consolidation.png")
    metrics = {f"{m}.{d}": v for m, ss in scores.items() for d, v in ss.items()}
    metrics |= {f"recovery.{m}.{d}": v for m, rr in recovery.items() for d, v in rr.items() if v is not None}
    return {"metrics": metrics}
