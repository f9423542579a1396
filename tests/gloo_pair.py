"""Two processes kept warm for the tests that compare a split over two gloo ranks with one rank.

`torch.multiprocessing.spawn` starts two fresh interpreters per test, and each imports torch, transformers, mbridge
and megatron-core again: 9.5 s measured for one process, and two of them on a 2-core machine. Some thirty such tests
paid about five minutes of `make test` for it. The pair imports once; each job still starts from a clean slate:
the job sets up its process group and Megatron's groups (as a fresh rank does), and after it both are torn down and
the RNGs reseeded. A rank that fails while its peer waits in a collective ends the pair (the next job starts a new
one), and the failure is raised with the rank's traceback, as `spawn` raises it.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import random
import time
import traceback

import torch
import torch.multiprocessing as mp

PEER_GRACE_S = 60  # how long the other rank may take to notice a failed peer before the pair is ended
# Megatron's process groups leave gloo's TCP loop threads behind after they are destroyed, and each polls its closed
# sockets: 64 of them in a pair burned 0.8 of 2 cores for the rest of a `make test` (2026-11-30). The pair starts
# afresh past this many, and ends with its test module (conftest.gloo_pair)
MAX_LOOP_THREADS = 32


def _reset() -> None:
    """What a job leaves behind: Megatron's groups, the process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _serve(rank: int, jobs, results) -> None:
    while (job := jobs.get()) is not None:
        fn, args = job
        torch.manual_seed(0)
        random.seed(0)
        try:
            fn(rank, *args)
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 - reported to the test, which raises it
            results.put((rank, traceback.format_exc()))
        finally:
            _reset()


class Pair:
    """`spawn(fn, args)`: `fn(rank, *args)` on both ranks (as `torch.multiprocessing.spawn(fn, args, nprocs=2)`)."""

    def __init__(self) -> None:
        self.procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(2)]
        self.results = ctx.Queue()
        # not daemonic: Megatron's distributed checkpoint writes through processes of its own; ended at exit (atexit
        # runs this before multiprocessing would wait for them)
        self.procs = [ctx.Process(target=_serve, args=(r, self.jobs[r], self.results)) for r in range(2)]
        for p in self.procs:
            p.start()
        atexit.register(self.close)

    def _leaked(self) -> bool:
        def loops(pid: int) -> int:
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:  # no procfs (not Linux): nothing measured, nothing restarted
                return 0
            n = 0
            for t in tasks:
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{t}/comm") as f:
                    n += f.read().strip() == "gloo_tcp_loop"
            return n
        return any(loops(p.pid) > MAX_LOOP_THREADS for p in self.procs)

    def spawn(self, fn, args: tuple, timeout: float = 900) -> None:
        if not self.procs or not all(p.is_alive() for p in self.procs) or self._leaked():
            self.close()
            self._start()
        for q in self.jobs:
            q.put((fn, args))
        errors, done = [], 0
        deadline = time.monotonic() + timeout
        while done < 2:
            try:
                rank, error = self.results.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    errors.append(f"rank {dead[0]} died" if dead else f"no answer in {timeout:.0f} s")
                    self.close()
                    break
                continue
            done += 1
            if error:
                errors.append(f"rank {rank}:\n{error}")
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)  # its peer may wait in a collective
        if errors:
            raise RuntimeError(f"{fn.__name__} failed on the gloo pair:\n" + "\n".join(errors))

    def close(self) -> None:
        for q in getattr(self, "jobs", []):
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.procs = []
