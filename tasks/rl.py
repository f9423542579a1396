"""rl node: one specialist per domain (the workflow starts the three concurrently)."""
from __future__ import annotations

from posttrain.artifacts import ArtifactRef
from posttrain.stages import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("rl", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8, workers=2)


@env.task
async def rl(ctx: RunContext, domain: str, sft: ArtifactRef, curate: ArtifactRef) -> ArtifactRef:
    return await run_stage(f"rl-{domain}", ctx, {"sft": sft, "curate": curate})
