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


def map_tasks(fn, calls: list[tuple], desc: str, num_cpus: float = 1.0) -> list:
    """fn(*args) for each args tuple: as parallel Ray tasks when Ray is up (a stage's work), else in-process."""
    from tqdm import tqdm
    if not ray.is_initialized():
        return [fn(*args) for args in tqdm(calls, desc=desc, mininterval=5, leave=False)]
    remote = ray.remote(fn).options(num_cpus=num_cpus, max_retries=0)
    refs = [remote.remote(*args) for args in calls]
    pending = list(refs)
    try:
        with tqdm(total=len(refs), desc=desc, mininterval=5, leave=False) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)  # fail fast: the first failed shard stops the map
                bar.update(len(done))
    except ray.exceptions.RayTaskError as e:
        for ref in pending:
            ray.cancel(ref)
        raise (getattr(e, "cause", None) or e) from None
    return ray.get(refs)
