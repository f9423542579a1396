"""curate node: the raw corpus artifact, then curated shards, SFT / RL / eval sets and a data card."""
from __future__ import annotations

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext
from tasks.common import run_stage, stage_env

env = stage_env("curate", cpu=4, memory="16Gi", workers=2)


@env.task
async def raw(ctx: RunContext) -> ArtifactRef:
    return await run_stage("raw", ctx, {})


@env.task
async def curate(ctx: RunContext, raw: ArtifactRef) -> ArtifactRef:
    return await run_stage("curate", ctx, {"raw": raw})
