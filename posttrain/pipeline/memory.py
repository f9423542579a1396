"""Peak memory of a block of work: the accelerator's allocator peak on GPU, sampled process RSS on CPU.

`resource.getrusage` only knows the peak of the whole process lifetime, so the per-stage CPU figure
comes from a background thread reading /proc/self/statm.
"""
from __future__ import annotations

import os
import resource
import threading
from contextlib import contextmanager

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:  # not Linux: the lifetime peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextmanager
def peak_memory(interval_s: float = 0.005):
    """`with peak_memory() as peak: ...` then `peak["mb"]` (and `peak["device"]`: "cuda" or "cpu-rss")."""
    out = {"mb": 0.0, "device": "cuda" if torch.cuda.is_available() else "cpu-rss"}
    if out["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
        try:
            yield out
        finally:
            out["mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            out["mb"] = max(out["mb"], rss_mb())
            stop.wait(interval_s)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out["mb"] = round(max(out["mb"], rss_mb()), 1)
