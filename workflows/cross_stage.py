"""The GLM-5 cross-stage recipe beside the GLM-5.2 one, on the same tasks (wiring only). With the default
rl.domains (reasoning, agentic, general; the chain follows their order):

sft -> rl reasoning -> xs agentic (distils rl reasoning) -> xs general (distils both)    cross-stage
                    -> seq agentic ------------------------> seq general               sequential RL
sft -> {rl reasoning | rl agentic | rl general} -> opd (multi-teacher)                  GLM-5.2
all three -> consolidation: per-domain score, recovery, forgetting and compute in report.json
"""
from __future__ import annotations

import flyte

from posttrain.pipeline import run as pipeline
from posttrain.config import load_config
from posttrain.pipeline.nodes import graph, upstream
from workflows.post_train import PipelineOutput, env as post_env, run_waves

env = flyte.TaskEnvironment(name="cross_stage_workflow", image=post_env.image, resources=post_env.resources,
                            cache="disable", depends_on=[post_env])  # post_env deploys every stage's task


@env.task(report=True)
async def cross_stage(profile: str = "tiny", overrides: list[str] = [], force: list[str] = [],  # noqa: B006
                      run_id: str = "") -> PipelineOutput:
    """Run the comparison: multi-teacher OPD, cross-stage distillation and sequential RL."""
    cfg = load_config(profile, list(overrides))
    g = graph(cfg)
    if "consolidation" not in g:
        raise ValueError(f"cross_stage: the chains need at least two rl.domains (got {cfg.rl.domains})")
    ctx = pipeline.start(cfg, run_id=run_id, force=list(force), tags={"posttrain.workflow": "cross_stage"})
    # the main DAG up to the generalist (reused from the cache when it already ran), then the two chains
    todo = upstream(g, "consolidation")
    refs = await run_waves(ctx, {}, todo, ("post_train", "cross_stage"))
    return PipelineOutput(ctx.run_id, f"{ctx.home}/runs/{ctx.run_id}/report.json", refs)
