"""opd node: multi-teacher on-policy distillation of the specialists into the SFT student."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("opd", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8, workers=2)


@env.task
async def opd(ctx: RunContext, sft: ArtifactRef, curate: ArtifactRef, specialists: dict[str, ArtifactRef]) -> ArtifactRef:
    return await run_stage("opd", ctx, {"sft": sft, "curate": curate, **specialists})
