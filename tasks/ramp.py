"""ramp node: staged context-length mid-training."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("ramp", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8, workers=2)


@env.task
async def ramp(ctx: RunContext, base: ArtifactRef, curate: ArtifactRef) -> ArtifactRef:
    return await run_stage("ramp", ctx, {"base": base, "curate": curate})
