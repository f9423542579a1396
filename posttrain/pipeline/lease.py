"""One run computes a node at a time: a lease per (stage, cache key) in the store itself, so runs on other
machines see it too (a local file lock would not be seen by a second node).

Leases are numbered files `LEASE.1`, `LEASE.2`, ... created exclusively (O_EXCL locally, a conditional PUT with
If-None-Match: * in an object store); the highest number is the current one. Taking over a dead holder's lease is
creating the next number, which only one waiter can do, so no lease is ever deleted or overwritten by anyone but
its holder. The holder renews its expiry every TTL/4 and expires it on release. A holder is dead when its expiry
passed, or at once when it ran on this host and its process is gone (a `kill -9`ed run is not waited for).

Correctness does not rest on the lease: publication is first-writer-wins (posttrain.pipeline.store), so two runs that
both compute a node (a holder presumed dead that was only slow) still converge on one artifact. The lease
saves the duplicate work and keeps two runs out of one resumable stage's scratch folder.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

from posttrain.pipeline.store import Store

TTL_S = float(os.environ.get("POSTTRAIN_LEASE_TTL_S", 120))
POLL_S = 2.0


class _Files:
    """Exclusive create, read and overwrite of small files under a local folder or a Store prefix."""

    def __init__(self, store: Store | None, home: str, rel: str):
        self.store, self.rel = store, rel
        self.local = Path(home) / rel

    def create(self, name: str, text: str) -> bool:
        if self.store:
            return self.store.create_text(f"{self.rel}/{name}", text)
        self.local.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.local / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def read(self, name: str) -> dict | None:
        text = self.store.get_text(f"{self.rel}/{name}") if self.store else \
            (self.local / name).read_text() if (self.local / name).exists() else None
        try:
            return json.loads(text) if text else None
        except ValueError:  # caught mid-write by a non-atomic filesystem: treat as held, look again later
            return {"expires": time.time() + POLL_S}

    def write(self, name: str, text: str) -> None:
        if self.store:
            self.store.put_text(f"{self.rel}/{name}", text)
        else:
            tmp = self.local / f".{name}.{os.getpid()}"
            tmp.write_text(text)
            os.replace(tmp, self.local / name)


def process_gone(host: str, pid: int | str) -> bool:
    """True when `pid` ran on this host and no longer exists (a process on another host: not known, False)."""
    if host != socket.gethostname() or not str(pid).isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it exists
        return False
    return False


def _alive(holder: dict) -> bool:
    return holder.get("expires", 0) >= time.time() and not process_gone(holder.get("host", ""), holder.get("pid", ""))


class Lease:
    """A held lease; renewed by a daemon thread until `release`."""

    def __init__(self, files: _Files, name: str, record: dict):
        self.files, self.name, self.record = files, name, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(TTL_S / 4):
            try:
                self.files.write(self.name, json.dumps({**self.record, "expires": time.time() + TTL_S}))
            except Exception:  # a store hiccup: the next renewal tries again, the TTL covers the gap
                pass

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.files.write(self.name, json.dumps({**self.record, "expires": 0, "released": time.time()}))
        except Exception:  # the lease then lapses by itself after TTL_S
            pass


async def hold(store: Store | None, home: str, stage: str, key: str, run_id: str) -> Lease:
    """Wait until this run may compute `stage` at `key`: until no live run holds its lease, then take it. The
    caller looks for a publication once it holds the lease (the run it waited for has usually just made one)."""
    files = _Files(store, home, f"artifacts/{stage}/.leases/{key[:16]}")
    record = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid()}
    said = False
    while True:
        n, current = 0, None
        while (found := files.read(f"LEASE.{n + 1}")) is not None:
            n, current = n + 1, found
        if current is None or not _alive(current):
            if files.create(f"LEASE.{n + 1}", json.dumps({**record, "expires": time.time() + TTL_S})):
                return Lease(files, f"LEASE.{n + 1}", record)
            continue  # another run took it first: look again
        if not said:
            print(f"[{stage}] run {current.get('run_id', '?')} is computing this node now: waiting for its "
                  f"artifact instead of computing it twice", flush=True)
            said = True
        await asyncio.sleep(POLL_S)
