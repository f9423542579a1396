"""sft node: chat-template SFT with thinking modes, assistant-only loss."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("sft", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8, workers=2)


@env.task
async def sft(ctx: RunContext, base: ArtifactRef, ramp: ArtifactRef, curate: ArtifactRef) -> ArtifactRef:
    return await run_stage("sft", ctx, {"base": base, "ramp": ramp, "curate": curate})
