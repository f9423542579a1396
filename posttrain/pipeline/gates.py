"""Regression gates: a checkpoint's greedy test scores against fixed minimums (`gates.min`) and against a
baseline checkpoint (`gates.max_drop`). Checked when a run finishes; a failure fails the run, names suite and
threshold, and keeps the model out of the registry."""
from __future__ import annotations

import environments
from posttrain.config import ConfigError, PipelineConfig
from posttrain.pipeline.graph import checkpoints


class GateFailure(RuntimeError):
    """A regression gate failed: the run is marked failed and its model is not registered."""


def suite_names(cfg: PipelineConfig) -> list[str]:
    domains = environments.names(cfg.world.environments)
    turns = [f"{d}:turns" for d in domains if hasattr(environments.get(d), "open_workspace")]  # turn-level thinking
    return [*domains, *(f"{d}:nothink" for d in domains), *turns, *(f"long_context@{L}" for L in cfg.eval_lengths())]


def validate_gates(cfg: PipelineConfig) -> None:
    """Refuse gates on unknown suites or checkpoints before any work is done."""
    g, known, cks = cfg.gates, suite_names(cfg), checkpoints(cfg)
    for field in ("checkpoint", "baseline"):
        if getattr(g, field) not in cks:
            raise ConfigError(f"gates.{field}: {getattr(g, field)!r} is not an evaluated checkpoint "
                              f"(known: {', '.join(cks)})")
    for field in ("nothink_on", "benchmarks_on"):
        if unknown := [ck for ck in getattr(cfg.eval, field) or [] if ck not in cks]:
            raise ConfigError(f"eval.{field}: {unknown} are not evaluated checkpoints (known: {', '.join(cks)})")
    for kind in ("min", "max_drop"):
        for suite in getattr(g, kind):
            if suite != "*" and suite not in known:
                raise ConfigError(f"gates.{kind}.{suite}: no such suite (known: *, {', '.join(known)})")
            # a gate compares the gated checkpoint's :nothink scores (every suite it has, for *) with its baseline's
            gated = [g.checkpoint] + ([g.baseline] if kind == "max_drop" else [])
            nothink = {cfg.eval.nothink(c) for c in gated}
            if suite.endswith(":nothink") and nothink != {True} or suite == "*" and len(nothink) > 1:
                raise ConfigError(f"gates.{kind}.{suite}: eval.nothink_on scores thinking off on "
                                  f"{cfg.eval.nothink_on} only; name {' and '.join(gated)} there too")
            if suite == "*" and len({cfg.eval.benchmarks(c) for c in gated}) > 1:
                raise ConfigError(f"gates.{kind}.*: eval.benchmarks_on scores the wheel benchmarks on "
                                  f"{cfg.eval.benchmarks_on} only; name {' and '.join(gated)} there too")


def check_gates(cfg: PipelineConfig, scores: dict[str, dict[str, float]]) -> dict:
    """Each configured gate on the gated checkpoint's greedy test scores, with a message naming suite and threshold."""
    g, checks = cfg.gates, []
    got = scores[g.checkpoint]
    for kind in ("min", "max_drop"):
        for key, limit in getattr(g, kind).items():
            for suite in (list(got) if key == "*" else [key]):
                if kind == "min":
                    ok = got[suite] >= limit
                    msg = (f"{g.checkpoint} scored {got[suite]:.3f} on {suite}, "
                           f"{'at or above' if ok else 'below'} gates.min.{key} = {limit}")
                else:
                    base = scores[g.baseline][suite]
                    ok = base - got[suite] <= limit + 1e-9
                    msg = (f"{g.checkpoint} scored {got[suite]:.3f} on {suite}, {base - got[suite]:+.3f} below "
                           f"{g.baseline} ({base:.3f}); gates.max_drop.{key} = {limit}")
                checks.append({"suite": suite, "gate": f"{kind}.{key}", "threshold": limit, "score": got[suite],
                               "passed": ok, "message": msg})
    return {"checkpoint": g.checkpoint, "baseline": g.baseline, "passed": all(c["passed"] for c in checks),
            "checks": checks}


def enforce_gates(report: dict) -> None:
    failed = [c["message"] for c in report.get("gates", {}).get("checks", []) if not c["passed"]]
    if failed:
        raise GateFailure("regression gate failed: " + "; ".join(failed)
                          + f" (report: {report.get('report_html', '')})")
