"""The GLM-5.2 post-training DAG (wiring only):

raw -> curate -> base -> ramp -> sft -> {rl reasoning | rl agentic | rl general} -> opd -> quantize -> evaluate
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import flyte

from posttrain import pipeline
from posttrain.gates import enforce_gates
from posttrain.artifacts import ArtifactRef
from posttrain.config import load_config
from posttrain.stages import CHAINS, CROSS_ORDER, DOMAIN_STAGES, STAGES, RunContext, ref_from_dict, stage_name
from tasks import base as base_t, cross_stage as cross_t, curate as curate_t, evaluate as evaluate_t, opd as opd_t, \
    quantize as quantize_t, ramp as ramp_t, rl as rl_t, sft as sft_t
from tasks.common import CPU

env = flyte.TaskEnvironment(
    name="post_train", image=CPU, resources=flyte.Resources(cpu="1", memory="2Gi"), cache="disable",
    depends_on=[curate_t.env, base_t.env, ramp_t.env, sft_t.env, rl_t.env, opd_t.env, quantize_t.env,
                evaluate_t.env, cross_t.env, cross_t.report_env])

# stages that may run together: the specialists are independent of each other
WAVES = [["raw"], ["curate"], ["base"], ["ramp"], ["sft"], list(DOMAIN_STAGES), ["opd"], ["quantize"], ["evaluate"]]
# workflows/cross_stage.py adds the GLM-5 chains (with and without distillation) and their comparison
CHAIN_WAVES = [*[[stage_name(c, d) for c in CHAINS] for d in CROSS_ORDER[1:]], ["consolidation"]]


@dataclass
class PipelineOutput:
    run_id: str
    report_path: str
    stages: dict[str, ArtifactRef] = field(default_factory=dict)


async def node(stage: str, ctx: RunContext, r: dict[str, ArtifactRef]) -> ArtifactRef:
    """Call the Flyte task of `stage` with its upstream artifacts."""
    if stage == "raw":
        return await curate_t.raw(ctx)
    if stage == "curate":
        return await curate_t.curate(ctx, r["raw"])
    if stage == "base":
        return await base_t.base(ctx, r["curate"])
    if stage == "ramp":
        return await ramp_t.ramp(ctx, r["base"], r["curate"])
    if stage == "sft":
        return await sft_t.sft(ctx, r["ramp"], r["curate"])
    if stage in DOMAIN_STAGES:
        return await rl_t.rl(ctx, stage[3:], r["sft"], r["curate"])
    if stage == "opd":
        return await opd_t.opd(ctx, r["sft"], r["curate"], {s: r[s] for s in DOMAIN_STAGES})
    if stage == "quantize":
        return await quantize_t.quantize(ctx, r["opd"], r["curate"])
    if stage == "evaluate":
        keep = ("base", "ramp", "sft", *DOMAIN_STAGES, "opd", "quantize", "curate")
        return await evaluate_t.evaluate(ctx, {s: r[s] for s in keep})
    if stage == "consolidation":
        return await cross_t.consolidation(ctx, {s: r[s] for s in STAGES[stage].inputs})
    if stage in STAGES:  # a stage of the cross-stage chains
        return await cross_t.chain_stage(ctx, stage, {s: r[s] for s in STAGES[stage].inputs})
    raise ValueError(f"unknown stage {stage!r}")


async def run_waves(ctx: RunContext, refs: dict[str, ArtifactRef], todo: set[str],
                    waves: list[list[str]] = WAVES) -> dict[str, ArtifactRef]:
    t0 = time.time()
    try:
        for wave in waves:
            stages = [s for s in wave if s in todo]
            outs = await asyncio.gather(*(node(s, ctx, refs) for s in stages))
            refs.update(zip(stages, outs))
    except BaseException:
        pipeline.fail(ctx)
        raise
    report = pipeline.finish(ctx, refs, time.time() - t0,
                             {"reused": sorted(set(refs) - todo)} if set(refs) - todo else None)
    if report.get("report_html"):  # the HTML report as this run's Flyte report
        from posttrain.report_html import body
        await flyte.report.replace.aio(body(report, Path(report["report_html"]).parent))
        await flyte.report.flush.aio()
    enforce_gates(report)
    return refs


@env.task(report=True)
async def post_train(profile: str = "tiny", overrides: list[str] = [], force: list[str] = [],  # noqa: B006
                     run_id: str = "") -> PipelineOutput:
    """Run every node of the DAG (cached nodes are reused by digest)."""
    cfg = load_config(profile, list(overrides))
    ctx = pipeline.start(cfg, run_id=run_id, force=list(force))
    refs = await run_waves(ctx, {}, {s for w in WAVES for s in w})
    return PipelineOutput(ctx.run_id, f"{ctx.home}/runs/{ctx.run_id}/report.json", refs)


@env.task(report=True)
async def rerun(stage: str, from_run: str, overrides: list[str] = [], downstream: bool = False,  # noqa: B006
                run_id: str = "") -> PipelineOutput:
    """Redo `stage` (and, if asked, what follows it) with upstream artifacts taken from `from_run`."""
    from posttrain.config import apply_overrides, config_from_dict
    from posttrain.stages import downstream as downstream_of
    report, old_cfg = pipeline.load_run(from_run)
    cfg = config_from_dict(apply_overrides(old_cfg.model_dump(mode="json"), list(overrides)),
                           f"run {from_run} with --set {list(overrides)}")
    # downstream nodes the earlier run had (a main-DAG run has no cross-stage chains to redo)
    todo = {s for s in downstream_of(stage) if s in report["stages"]} | {stage} if downstream else {stage}
    refs = {s: ref_from_dict({"stage": s, "path": v["artifact"], "sha256": v["sha256"],
                              "mlflow_run_id": v["mlflow_run_id"], "cached": True})
            for s, v in report["stages"].items() if s not in todo}
    ctx = pipeline.start(cfg, run_id=run_id, force=[stage],
                         tags={"posttrain.rerun_of": report["run_id"], "posttrain.rerun_stage": stage})
    refs = await run_waves(ctx, refs, todo, WAVES + CHAIN_WAVES)
    return PipelineOutput(ctx.run_id, f"{ctx.home}/runs/{ctx.run_id}/report.json", refs)
