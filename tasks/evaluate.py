"""evaluate node: every checkpoint on every suite."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("evaluate", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=1)


@env.task
async def evaluate(ctx: RunContext, checkpoints: dict[str, ArtifactRef]) -> ArtifactRef:
    return await run_stage("evaluate", ctx, checkpoints)
