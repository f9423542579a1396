"""cross-stage nodes: one RL stage of the GLM-5 chain (with or without distilling from earlier stages),
and the consolidation report comparing multi-teacher OPD, cross-stage and sequential RL."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import CPU, GPU_TRAIN, run_stage, stage_env

env = stage_env("cross_stage", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8, workers=2)
report_env = stage_env("consolidation", img=CPU, cpu=2, memory="8Gi")


@env.task
async def chain_stage(ctx: RunContext, stage: str, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
    return await run_stage(stage, ctx, inputs)


@report_env.task
async def consolidation(ctx: RunContext, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
    return await run_stage("consolidation", ctx, inputs)
