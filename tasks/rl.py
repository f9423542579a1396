"""rl node: one specialist per domain of rl.domains (the workflow starts them concurrently)."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("rl", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8, workers=2)


@env.task
async def rl(ctx: RunContext, stage: str, sft: ArtifactRef, curate: ArtifactRef) -> ArtifactRef:
    return await run_stage(stage, ctx, {"sft": sft, "curate": curate})
