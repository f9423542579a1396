"""One lean local Ray instance for the whole run, and a helper to run stage work as a Ray task."""
from __future__ import annotations

import os

import ray

from posttrain.config import RuntimeConfig


def ensure_ray(rt: RuntimeConfig) -> None:
    """Start (or join) Ray with declared CPUs, no dashboard and a small object store."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    address = os.environ.get("RAY_ADDRESS")
    if address:  # on a KubeRay cluster the RayJob sets this
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(num_cpus=rt.ray_num_cpus, include_dashboard=False, object_store_memory=rt.object_store_mb << 20,
             log_to_driver=True, configure_logging=False)


def _call(fn_path: str, threads: int, *args, **kwargs):
    import importlib

    import torch
    torch.set_num_threads(threads)
    mod, name = fn_path.split(":")
    return getattr(importlib.import_module(mod), name)(*args, **kwargs)


_remote_call = ray.remote(_call)


def submit(fn_path: str, num_cpus: float, threads: int, *args, **kwargs) -> ray.ObjectRef:
    """Run `module:function` as a Ray task reserving `num_cpus`, with `threads` torch threads."""
    return _remote_call.options(num_cpus=num_cpus, max_retries=0).remote(fn_path, threads, *args, **kwargs)
