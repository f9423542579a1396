"""base node: a local HF checkpoint, or the tiny preset's tokenizer + brief pretraining."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import GPU_TRAIN, run_stage, stage_env

env = stage_env("base", img=GPU_TRAIN, cpu=8, memory="64Gi", gpu=8)


@env.task
async def base(ctx: RunContext, curate: ArtifactRef) -> ArtifactRef:
    return await run_stage("base", ctx, {"curate": curate})
