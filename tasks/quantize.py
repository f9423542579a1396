"""quantize node: W4A8 checkpoint."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import run_stage, stage_env

env = stage_env("quantize", cpu=4, memory="32Gi")


@env.task
async def quantize(ctx: RunContext, opd: ArtifactRef, curate: ArtifactRef) -> ArtifactRef:
    return await run_stage("quantize", ctx, {"opd": opd, "curate": curate})
