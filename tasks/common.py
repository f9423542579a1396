"""Where tasks run: container images, resources and the KubeRay job each stage asks for.

Locally (`flyte run --local`, `posttrain run`) tasks run in this process tree and do their work
through one lean local Ray instance; remotely each task is a RayJob on KubeRay.
"""
from __future__ import annotations

import flyte
from flyteplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.pipeline.nodes import RunContext, execute

# Images are references resolved from flyte.yaml `image.image_refs` (or `--image cpu=URI`): CI builds
# containers/<name>/Dockerfile and passes the URI, so deploy never builds anything itself.
CPU = flyte.Image.from_ref_name("cpu")
GPU_TRAIN = flyte.Image.from_ref_name("gpu-train")


def ray_job(workers: int, cpu: int, memory: str, gpu: int = 0) -> RayJobConfig:
    # strings: the kubernetes client validates pod resources as quantities
    res = flyte.Resources(cpu=str(cpu), memory=memory, gpu=gpu) if gpu else flyte.Resources(cpu=str(cpu), memory=memory)
    return RayJobConfig(
        head_node_config=HeadNodeConfig(ray_start_params={"num-cpus": "0"},
                                        requests=flyte.Resources(cpu="1", memory="2Gi")),
        worker_node_config=[WorkerNodeConfig(group_name="workers", replicas=workers, requests=res)],
        shutdown_after_job_finishes=True, ttl_seconds_after_finished=600)


def stage_env(name: str, *, img: flyte.Image = CPU, cpu: int = 2, memory: str = "8Gi", workers: int = 1,
              gpu: int = 0) -> flyte.TaskEnvironment:
    # caching is ours (content-addressed on config, source closure and input digests): Flyte's
    # cache="auto" hashes only the task body and would serve stale results after a helper change.
    return flyte.TaskEnvironment(name=name, image=img, resources=flyte.Resources(cpu="1", memory="2Gi"),
                                 plugin_config=ray_job(workers, cpu, memory, gpu), cache="disable")


async def run_stage(stage: str, ctx: RunContext, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
    """Tag the node with its Flyte run and action, then execute it."""
    fctx = flyte.ctx()  # falsy outside a Flyte task (library use, tests)
    if fctx and fctx.action:
        ctx.tags = {**ctx.tags, "flyte.run": str(fctx.action.run_name), "flyte.action": str(fctx.action.name)}
    return await execute(stage, ctx, inputs)
