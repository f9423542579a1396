"""consolidation: the comparison of three ways to end with one model that keeps every specialist's gain:
multi-teacher OPD (the GLM-5.2 recipe), cross-stage distillation and plain sequential RL (the GLM-5
recipe and its baseline, workflows/cross_stage.py). Per domain: test score, recovery of the specialist's
gain over sft, forgetting; per method: compute (student tokens generated, teacher tokens scored, wall)."""
from __future__ import annotations

import json
from pathlib import Path

from posttrain.config import PipelineConfig
from posttrain.data import load_tasks
from posttrain.pipeline.artifacts import read_manifest
from posttrain.pipeline.console import kv
from posttrain.pipeline.nodes import stage_name
from posttrain.stages.evaluate import evaluate_checkpoint
from posttrain.stages.opd import tokens_to_reach

CHAIN_OF = {"cross_stage": "xs", "sequential_rl": "seq"}


def methods(order: list[str]) -> dict[str, str]:
    """Each way to one model -> the stage holding it: OPD's generalist and the end of each chain."""
    return {"multi_teacher_opd": "opd", **{m: stage_name(c, order[-1], order) for m, c in CHAIN_OF.items()}}


def midway(order: list[str]) -> dict[str, str]:
    """Rows for the chains' middle stages (after the agentic stage, by default): forgetting shows there."""
    return {f"{m}_after_{d}": stage_name(c, d, order) for d in order[1:-1] for m, c in CHAIN_OF.items()}


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
    domains = list(c["n_test_per_domain"])
    rows = ["| model | " + " | ".join(f"{d} (recovery)" for d in domains) + " | student tokens | teacher tokens |"
            " wall s |", "|---" * (len(domains) + 4) + "|"]
    for name in c["scores"]:
        s, rec, comp = c["scores"][name], c["recovery"].get(name, {}), c["compute"].get(name, {})
        cells = [f"{s[d]:.2f}" + (f" ({rec[d]:.0%})" if rec.get(d) is not None else "") for d in domains]
        extra = [f"{comp[k]:,.0f}" if comp else "" for k in ("student_tokens", "teacher_tokens", "wall_s")]
        rows.append(f"| {name} | " + " | ".join(cells + extra) + " |")
    return "\n".join(rows)


def plot(c: dict, path: Path) -> None:
    import matplotlib  # heavy, for this figure only; its backend is set before pyplot is imported
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    domains = list(c["n_test_per_domain"])
    names = ["sft", "specialist", *c["recovery"]]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + i * w for j in range(len(domains))], [c["scores"][n][d] for d in domains], w, label=n)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(domains))], domains)
    ax.set(ylabel="test score (greedy)", ylim=(0, 1.2), title=f"one model from {len(domains)} specialists")
    ax.legend(fontsize=7, ncol=len(names), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    n, order = cfg.cross_stage.eval_n or None, cfg.rl.domains
    tests = {d: load_tasks(inputs["curate"], "test", d)[:n] for d in order}
    scores = {"sft": test_scores(inputs["sft"], tests, cfg)}
    specialists = {d: test_scores(inputs[f"rl-{d}"], tests, cfg) for d in order}
    scores["specialist"] = {d: specialists[d][d] for d in order}  # each on its own domain
    for name, stage in {**methods(order), **midway(order)}.items():
        scores[name] = test_scores(inputs[stage], tests, cfg)
        print(f"[consolidation] {name}: {kv(scores[name])}", flush=True)
    sft, spec = scores["sft"], scores["specialist"]
    recovery = {name: {d: round((scores[name][d] - sft[d]) / (spec[d] - sft[d]), 3) if spec[d] != sft[d] else None
                       for d in order} for name in methods(order)}
    # forgetting: a domain's score right after its own stage minus its score at the end of the chain
    after_own = {m: {order[0]: spec[order[0]], **{d: scores[f"{m}_after_{d}"][d] for d in order[1:-1]}}
                 for m in CHAIN_OF}
    forgetting = {m: {d: round(v - scores[m][d], 4) for d, v in own.items()} for m, own in after_own.items()}
    compute = {"multi_teacher_opd": compute_of(inputs, ["opd"]),
               "multi_teacher_opd_incl_specialists": compute_of(inputs, ["opd", *(f"rl-{d}" for d in order)]),
               **{m: compute_of(inputs, [stage_name(c, d, order) for d in order]) for m, c in CHAIN_OF.items()}}
    opd_m = read_manifest(inputs["opd"])["metrics"]
    efficiency = {}
    for d in order:
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
