"""One lean local Ray instance for the whole run, and a helper to run stage work as a Ray task."""
from __future__ import annotations

import contextlib
import gc
import importlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import ray
from tqdm import tqdm

from posttrain.config import RuntimeConfig
from posttrain.pipeline.console import ANSI
from posttrain.pipeline.store import restore_scratch


def ensure_ray(rt: RuntimeConfig, log_path: str | Path | None = None) -> None:
    """Start (or join) Ray with declared CPUs, no dashboard and a small object store. With `log_path`,
    Ray's own internals go to that file instead of the terminal (see `route_worker_logs`)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    address = os.environ.get("RAY_ADDRESS")
    if address:  # on a KubeRay cluster the RayJob sets this
        ray.init(address=address, log_to_driver=True)
    else:
        start_local(num_cpus=rt.ray_num_cpus, include_dashboard=False, object_store_memory=rt.object_store_mb << 20,
                    log_to_driver=True, configure_logging=False)
    if log_path:
        route_worker_logs(Path(log_path))


START_TRIES = 3


def start_local(**init_args) -> None:
    """`ray.init(**init_args)` for a new local node, one posttrain process at a time on this machine, started again
    if it misses Ray's startup deadline. Ray gives a new node's raylet a fixed 30 s to register (ray/_private/node.py);
    on a busy 2-core machine with several runs starting at once (CI's concurrent-run tests) it can miss that, and the
    run died before its first node. The lock keeps the starts from competing; a miss kills what the failed start
    left and tries again."""
    import fcntl  # POSIX only, as Ray's local node is
    import psutil  # a dependency of ray[default]
    me = psutil.Process()
    with open(Path(tempfile.gettempdir()) / f"posttrain-ray-start-{os.getuid()}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        for attempt in range(1, START_TRIES + 1):
            before = {p.pid for p in me.children()}  # direct children only: another run's Ray is a grandchild
            try:
                ray.init(**init_args)
                return
            except Exception as e:  # Ray raises a bare Exception for this
                if "timed out during startup" not in str(e) or attempt == START_TRIES:
                    raise
            ray.shutdown()
            for child in me.children():
                if child.pid not in before:  # the failed start's GCS, raylet and reaper, with what they started
                    with contextlib.suppress(psutil.Error):
                        family = [*child.children(recursive=True), child]
                        for p in family:
                            with contextlib.suppress(psutil.Error):
                                p.kill()
            print(f"Ray's node did not register within Ray's 30 s (a busy machine?): starting it again "
                  f"({attempt + 1}/{START_TRIES})", file=sys.stderr, flush=True)


# Ray Train's helper actors and Ray's C++ log lines (glog: "[date time,ms E pid tid] file.cc:line: ...") say
# nothing a user can act on; worker lines of our own (progress bars, stage messages) stay on the terminal.
_INTERNAL_ACTORS = {"TrainController", "PlacementGroupCleaner", "PreemptionWatcher"}
_INTERNAL_LINE = re.compile(
    r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [DIWEF] \d+ \d+\]|\.cc:\d+:|Failed to query Ray Train Controller|"
    r"Reporting training result|Checkpoint successfully created|Setting up process group|Moving model to device|"
    r"Wrapping provided model|training worker group|world_rank=")


def route_worker_logs(path: Path) -> None:
    """Forward worker output to the terminal as Ray does, except Ray's internals, which go to `path`.

    Ray has no public filter for forwarded worker logs, so this swaps the driver's print handler on its
    stdstream dispatcher (ray._private.worker, Ray 2.x); if that API is gone, Ray's default stays."""
    from ray._private import worker as ray_worker  # ray: only where the work spreads over Ray workers
    dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
    if dispatcher is None or not hasattr(ray_worker, "print_to_stdstream"):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the driver

    def handle(data: dict) -> None:
        internal = (data.get("actor_name") or data.get("task_name") or "") in _INTERNAL_ACTORS
        keep = [] if internal else [x for x in data["lines"] if not _INTERNAL_LINE.search(x)]
        origin = f"({data.get('actor_name') or data.get('task_name') or ''} pid={data.get('pid')})"
        for line in data["lines"]:
            if internal or _INTERNAL_LINE.search(line):
                log.write(f"{origin} {line}\n")
        if not keep:
            return
        tty = (sys.stderr if data.get("is_err") else sys.stdout).isatty()
        if not tty:  # a file or a pipe: the lines as the stage printed them, without Ray's coloured `(_call pid=..)`
            keep = [ANSI.sub("", line) for line in keep]
        ray_worker.print_to_stdstream({**data, "lines": keep}, ignore_prefix=not tty)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("posttrain_print_logs", handle)


_STAGE_ENV: dict[str, str] = {}  # the running stage's own variables (see `submit`)


@contextlib.contextmanager
def _stage_variables(stage_env: dict[str, str]):
    """`stage_env` set in this (reused) worker for one call, and the worker's own values back after it."""
    saved = {k: os.environ.get(k) for k in stage_env}
    os.environ.update(stage_env)
    _STAGE_ENV.update(stage_env)
    try:
        yield
    finally:
        _STAGE_ENV.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _call(fn_path: str, threads: int, stage_env: dict[str, str], *args, **kwargs):
    import torch  # in the Ray worker only: the driver process (the CLI) does not load torch
    gc.collect()  # a failed stage before this one in the worker may have left actor handles in cycles: they go now
    torch.set_num_threads(threads)
    try:
        with _stage_variables(stage_env):
            if kwargs.get("scratch"):  # where the work runs: a resumable stage lost with its machine resumes here
                restore_scratch(kwargs["scratch"])
            mod, name = fn_path.split(":")
            out = getattr(importlib.import_module(mod), name)(*args, **kwargs)
    finally:
        release_memory()
    # which Ray node did the work (on a cluster: a worker node, never the head with num-cpus 0)
    return {**out, "ray_node": ray.get_runtime_context().get_node_id()} if isinstance(out, dict) else out


def release_memory() -> None:
    """Hand a finished stage's heap back to the OS. glibc keeps freed pages: after the small profile's ramp its
    worker held 8.5 GB, and the sft beside it ran out of memory."""
    import ctypes  # ctypes: only to call glibc's malloc_trim
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # musl and others: nothing to trim
            pass


# A CPU stage's worker serves the next stage: torch, transformers and our modules stay imported (~10 s a stage; a
# smoke run has 11), and `release_memory` returns its heap. A GPU stage's exits after it, as Ray's default for GPU
# tasks: CUDA keeps the device it first saw, and the next stage may be given another.
_remote_call, _remote_call_gpu = ray.remote(max_calls=0)(_call), ray.remote(max_calls=1)(_call)


def submit(fn_path: str, num_cpus: float, threads: int, *args, env_vars: dict[str, str] | None = None,
           stage_env: dict[str, str] | None = None, num_gpus: float = 0.0, **kwargs) -> ray.ObjectRef:
    """Run `module:function` as a Ray task reserving `num_cpus`, with `threads` torch threads. `env_vars` (the
    same for every stage of a run) reach it and every task and actor it starts (Ray's runtime_env is inherited);
    `stage_env` (this call's own) is set in the worker for the call and reaches the actors started with
    `actor_options`. Two calls with different `env_vars` cannot share a worker."""
    options = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
    return (_remote_call_gpu if num_gpus else _remote_call).options(
        num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0, **options).remote(
        fn_path, threads, stage_env or {}, *args, **kwargs)


def wait_for_actors(actors: list, what: str, fix: str, place_s: float = 180.0) -> None:
    """Until each of `actors` (with a `ready` method) is built. An actor that no node has taken after `place_s`
    (no free share of CPU: stages at once holding what it needs) raises, naming `what` and `fix`, rather than
    waiting forever; one that a node has taken and is still loading is waited for however long the machine needs
    (on a busy 2-core machine a rollout worker's imports and checkpoint load took over 180 s)."""
    refs = [a.ready.remote() for a in actors]
    deadline, pending = time.monotonic() + place_s, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=5)
        ray.get(done)  # an actor that failed to build raises here, at once
        if pending and time.monotonic() > deadline:
            unplaced = sum(not _placed(a) for a, r in zip(actors, refs) if r in pending)
            if unplaced:
                raise RuntimeError(f"{unplaced} {what} could not be scheduled in {place_s:.0f} s: {fix}")


def _placed(actor) -> bool:
    """Whether a node has started a worker process for `actor` (GCS's actor table: a pid once placed)."""
    from ray._private import state  # no public API tells placed-and-building from waiting for resources
    try:
        return bool((state.actors(actor._actor_id.hex()) or {}).get("Pid"))
    except Exception:  # another Ray's table: as before, a slow build counts as unplaced
        return False


def actor_options(**options) -> dict:
    """Ray `.options(...)` for an actor a stage starts: the stage's own variables go with it (Ray merges these
    env_vars into the inherited runtime_env)."""
    return {**options, "runtime_env": {"env_vars": dict(_STAGE_ENV)}} if _STAGE_ENV else options


def _map_call(fn, stage_env: dict[str, str], *args):
    with _stage_variables(stage_env):
        return fn(*args)


def map_tasks(fn, calls: list[tuple], desc: str, num_cpus: float = 1.0) -> list:
    """fn(*args) for each args tuple: as parallel Ray tasks when Ray is up (a stage's work), else in-process."""
    if not ray.is_initialized():
        return [fn(*args) for args in tqdm(calls, desc=desc, mininterval=5, leave=False)]
    remote = ray.remote(_map_call).options(num_cpus=num_cpus, max_retries=0)
    refs = [remote.remote(fn, dict(_STAGE_ENV), *args) for args in calls]  # the stage's variables go with its shards
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
