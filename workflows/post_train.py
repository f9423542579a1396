"""The GLM-5.2 post-training DAG (wiring only; the graph itself is posttrain.pipeline.nodes.graph):

raw -> curate -> base -> ramp -> sft -> {rl-<domain> for each of rl.domains} -> opd -> quantize -> evaluate
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import flyte

from posttrain.pipeline import run as pipeline
from posttrain.pipeline.gates import enforce_gates
from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.config import PipelineConfig, load_config
from posttrain.pipeline.nodes import RunContext, Stage, graph, ref_from_dict, waves
from tasks.common import CPU


def task_of(stage: Stage):
    module, name = stage.task.split(":")
    return getattr(importlib.import_module(module), name)


# every stage's task environment, from the graph (deploying the workflow deploys them)
TASK_ENVS = list({id(e): e for e in (task_of(s).parent_env() for s in graph(PipelineConfig()).values())}.values())
env = flyte.TaskEnvironment(name="post_train", image=CPU, resources=flyte.Resources(cpu="1", memory="2Gi"),
                            cache="disable", depends_on=TASK_ENVS)


@dataclass
class PipelineOutput:
    run_id: str
    report_path: str
    stages: dict[str, ArtifactRef] = field(default_factory=dict)


def bind(stage: Stage, task, refs: dict[str, ArtifactRef]) -> dict:
    """The task's arguments by name: `stage` its stage name, a parameter named after an input that input's
    artifact, a dict parameter the remaining inputs."""
    params = [p for p in inspect.signature(task.func).parameters.values() if p.name != "ctx"]
    named = {p.name for p in params} & set(stage.inputs)
    args = {p.name: stage.name for p in params if p.name == "stage"} | {k: refs[k] for k in named}
    rest = [p.name for p in params if p.name not in args]
    if len(rest) > 1:
        raise TypeError(f"{stage.task}: parameters {rest} match no input of stage {stage.name}")
    return args | ({rest[0]: {k: refs[k] for k in stage.inputs if k not in named}} if rest else {})


async def node(stage: Stage, ctx: RunContext, refs: dict[str, ArtifactRef]) -> ArtifactRef:
    """Call the Flyte task of `stage` with its upstream artifacts."""
    task = task_of(stage)
    return await task(ctx, **bind(stage, task, refs))


async def gather_bounded(calls: list[Callable[[], Awaitable]], limit: int) -> list:
    """Await every call, at most `limit` at once (0: all), each to its end; results (or exceptions) in order."""
    gate = asyncio.Semaphore(limit or max(1, len(calls)))

    async def one(call):
        async with gate:
            return await call()
    return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)


async def run_waves(ctx: RunContext, refs: dict[str, ArtifactRef], todo: set[str],
                    workflows: tuple[str, ...] = ("post_train",), stale: set[str] = frozenset()
                    ) -> dict[str, ArtifactRef]:
    """Run the stages in `todo` of the named workflows, wave after wave (upstream artifacts from `refs`); `stale`:
    the nodes of `refs` an earlier run computed from what this one redid (reported as such, never registered)."""
    t0, g = time.time(), graph(ctx.cfg())
    ran = tuple(w for w in workflows if any(g[s].workflow == w for s in todo))  # what a rerun of this run redoes
    try:
        for wave in (w for wf in workflows for w in waves(g, wf)):
            stages = [s for s in wave if s in todo]
            # every node of the wave finishes (or fails) before the first failure is raised: what finished is kept
            outs = await gather_bounded([functools.partial(node, g[s], ctx, refs) for s in stages],
                                        ctx.cfg().runtime.parallel_stages)
            refs.update((s, o) for s, o in zip(stages, outs) if not isinstance(o, BaseException))
            if failed := next((o for o in outs if isinstance(o, BaseException)), None):
                raise failed
            if stages:
                pipeline.save_partial(ctx, refs, ran)
    except BaseException:
        try:
            pipeline.fail(ctx, refs, ran)
        except Exception as e:  # the stage's own error is the one to see: the bookkeeping's is only reported
            print(f"[pipeline] the failed run's finished stages were not recorded: {e!r}", file=sys.stderr, flush=True)
        raise
    extra = {"reused": sorted(set(refs) - todo)} if set(refs) - todo else {}
    report = pipeline.finish(ctx, refs, time.time() - t0, extra | ({"stale": sorted(stale)} if stale else {}))
    if report.get("report_html"):  # the HTML report as this run's Flyte report
        from posttrain.pipeline.report_html import body
        await flyte.report.replace.aio(body(report, Path(report["report_html"]).parent))
        await flyte.report.flush.aio()
    enforce_gates(report)
    return refs


@env.task(report=True)
async def post_train(profile: str = "tiny", overrides: list[str] = [], force: list[str] = [],  # noqa: B006
                     run_id: str = "") -> PipelineOutput:
    """Run every node of the DAG (cached nodes are reused by digest)."""
    cfg = load_config(profile, list(overrides))
    ctx = pipeline.start(cfg, run_id=run_id, force=list(force))
    refs = await run_waves(ctx, {}, {s.name for s in graph(cfg).values() if s.workflow == "post_train"})
    return PipelineOutput(ctx.run_id, f"{ctx.home}/runs/{ctx.run_id}/report.json", refs)


def rerun_downstream(g: dict[str, Stage], stage: str, report: dict) -> set[str]:
    """The nodes after `stage` that the earlier run had: a failed run's report holds only what finished, so for it
    every node after `stage` in the workflows it was running (partial.json's `workflows`)."""
    from posttrain.pipeline.nodes import downstream
    ran = report.get("workflows", ["post_train"])
    return {s for s in downstream(g, stage) if s != stage and (s in report["stages"] or report.get("failed")
                                                                and g[s].workflow in ran)}


@env.task(report=True)
async def rerun(stages: list[str], from_run: str, overrides: list[str] = [], downstream: bool = False,  # noqa: B006
                run_id: str = "") -> PipelineOutput:
    """Redo `stages` (siblings such as the RL specialists at once; and, if asked, what follows them) with upstream
    artifacts taken from `from_run`."""
    from posttrain.config import apply_overrides, config_from_dict
    report, old_cfg = pipeline.load_run(from_run)
    cfg = config_from_dict(apply_overrides(old_cfg.model_dump(mode="json"), list(overrides)),
                           f"run {from_run} with --set {list(overrides)}")
    # downstream nodes the earlier run had (a main-DAG run has no cross-stage chains to redo)
    g = graph(cfg)
    if unknown := [s for s in stages if s not in g]:
        raise ValueError(f"unknown stage {unknown[0]!r}; stages: {', '.join(g)}")
    after = set().union(*(rerun_downstream(g, s, report) for s in stages)) - set(stages)
    todo = after | set(stages) if downstream else set(stages)
    # a reused node keeps the figures the earlier report had of it (the expert load's CV in base)
    refs = {s: ref_from_dict({"stage": s, "path": v["artifact"], "sha256": v["sha256"],
                              "mlflow_run_id": v["mlflow_run_id"], "cached": True,
                              "metrics": report.get("moe", {}).get(s, {})})
            for s, v in report["stages"].items() if s not in todo}
    ctx = pipeline.start(cfg, run_id=run_id, force=list(stages),
                         tags={"posttrain.rerun_of": report["run_id"], "posttrain.rerun_stage": ",".join(stages)})
    refs = await run_waves(ctx, refs, todo, ("post_train", "cross_stage"), stale=(after - todo) & set(refs))
    return PipelineOutput(ctx.run_id, f"{ctx.home}/runs/{ctx.run_id}/report.json", refs)
