"""Artifacts: folders with a manifest (sha256 of every file, parents, config digest, code version).

Writes are atomic: a stage writes into a temp folder beside the target and renames it into place,
so a crash never leaves a half artifact that a later node could consume.

The digest covers what the stage computed, never what a clock measured: a stage's `history.json` loses its
wall-clock curves (seconds, tokens per second: `is_timing`) to `timings.json` beside it when the manifest is
written, and `timings.json` is listed under `timing_files` (checked by `verify`) but not hashed into the digest. So
a node recomputed to the same weights and curves gets the same digest, and everything downstream of it stays cached.
`read_with_timings` gives both back as one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from posttrain.config import ROOT

MANIFEST = "manifest.json"
SOURCE = "source.json"  # in a base artifact made from base.init_from: the checkpoint it copied
HISTORY = "history.json"  # a training stage's curves, step by step
TIMINGS = "timings.json"  # the wall-clock curves of the history.json beside it: verified, not in the digest


class DigestMismatch(RuntimeError):
    """An artifact's files do not match its manifest, or the manifest not the expected digest."""


@dataclass
class ArtifactRef:
    """What flows between DAG nodes: where an artifact lives and the digest it must have."""
    stage: str
    path: str
    sha256: str
    mlflow_run_id: str = ""
    seconds: float = 0.0
    cached: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def git_sha() -> str:
    """The code's commit (with -dirty for uncommitted changes); in an image, the GIT_SHA it was built with."""
    if baked := os.environ.get("POSTTRAIN_GIT_SHA"):
        return baked
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() or "nogit"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "nogit"


_FILE_DIGESTS: dict[tuple[str, int, int], str] = {}


def sha256_file_cached(path: Path) -> str:
    """sha256_file, remembered per (path, size, mtime_ns): a multi-GB checkpoint is read once per process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_DIGESTS:
        _FILE_DIGESTS[key] = sha256_file(path)
    return _FILE_DIGESTS[key]


def dir_digest(folder: Path | str) -> str:
    """sha256 over the relative path and content of every file under `folder`. `.cache` is left out:
    `huggingface-cli download --local-dir` keeps download metadata there that changes on a no-op refetch."""
    folder = Path(folder)
    return sha256_json({str(p.relative_to(folder)): sha256_file_cached(p) for p in sorted(folder.rglob("*"))
                        if p.is_file() and ".cache" not in p.relative_to(folder).parts})


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file the artifact digest covers (all but the manifest and timings.json)."""
    return {str(p.relative_to(folder)): sha256_file(p)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (MANIFEST, TIMINGS)}


def timing_digests(folder: Path) -> dict[str, str]:
    """sha256 of every timings.json under `folder`: checked, but outside the artifact digest."""
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob(TIMINGS)) if p.is_file()}


def is_timing(key: str) -> bool:
    """A history curve measured by a clock: seconds and rates per second end in `_s` (`train_s`, `wall_s`,
    `val_wall_s`, `gen_tokens_per_s`) or in `seconds`; a `@<seq_len>` or `/<domain>` suffix is looked through."""
    return re.split(r"[@/]", key, maxsplit=1)[0].endswith(("_s", "seconds"))


def split_timings(folder: Path) -> None:
    """Move the wall-clock curves of every history.json under `folder` into the timings.json beside it (merged
    with one the stage wrote itself): the rest of the history is what the training computed, the same on a rerun
    that computes the same weights."""
    for path in sorted(folder.rglob(HISTORY)):
        try:
            hist = json.loads(path.read_text())
        except ValueError:
            continue  # not JSON: hashed as it is
        if not isinstance(hist, dict) or not (timings := {k: hist.pop(k) for k in list(hist) if is_timing(k)}):
            continue
        beside = path.with_name(TIMINGS)
        if beside.is_file():
            timings = {**json.loads(beside.read_text()), **timings}
        beside.write_text(json.dumps(timings))
        path.write_text(json.dumps(hist))


def read_with_timings(folder: Path | str, name: str = HISTORY) -> dict:
    """A stage's JSON as it was measured: `history.json` (or `name`) with the figures of the timings.json beside it
    put back (wall-clock curves; quantize's memory figures)."""
    path = Path(folder) / name
    hist = json.loads(path.read_text())
    timings = path.with_name(TIMINGS)
    return {**hist, **json.loads(timings.read_text())} if timings.is_file() else hist


def write_manifest(folder: Path, *, stage: str, parents: dict[str, str], config_digest: str,
                   code_digest: str, mlflow_run_id: str, extra: dict | None = None) -> str:
    """Write manifest.json into `folder`; return the artifact digest (sha256 of its content part: every file but
    timings.json, which split_timings fills from history.json first, see the module docstring)."""
    split_timings(folder)
    files = file_digests(folder)
    body = {"stage": stage, "files": files, "parents": parents, "config_digest": config_digest,
            "code_digest": code_digest}
    digest = sha256_json(body)
    manifest = {**body, "sha256": digest, "git_sha": git_sha(), "mlflow_run_id": mlflow_run_id,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})}
    if timings := timing_digests(folder):
        manifest["timing_files"] = timings
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return digest


def read_manifest(folder: Path | str) -> dict:
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise DigestMismatch(f"{folder}: no {MANIFEST}; not a posttrain artifact (or a half-written one)")
    try:
        m = json.loads(path.read_text())
        if all(k in m for k in ("stage", "files", "parents", "config_digest", "code_digest", "sha256")):
            return m
    except (ValueError, TypeError):  # not JSON, or not an object: the same verdict as missing keys
        pass
    raise DigestMismatch(f"{path}: not a readable manifest (modified after it was written)")


def verify(folder: Path | str, expected: str | None = None) -> dict:
    """Re-hash every file; refuse a mismatch with the file name. Returns the manifest."""
    folder = Path(folder)
    m = read_manifest(folder)
    if expected and m["sha256"] != expected:
        raise DigestMismatch(f"{folder}: manifest digest {m['sha256'][:12]} != expected {expected[:12]}")
    actual, timings = file_digests(folder), timing_digests(folder)
    listed = m.get("timing_files") or {}
    for name, digest in [*m["files"].items(), *listed.items()]:
        have = timings if name in listed else actual
        if name not in have:
            raise DigestMismatch(f"{folder}: file {name} listed in manifest is missing")
        if have[name] != digest:
            raise DigestMismatch(f"{folder}: file {name} has sha256 {have[name][:12]}, "
                                 f"manifest says {digest[:12]} (modified after it was written)")
    extra = sorted((set(actual) - set(m["files"])) | (set(timings) - set(listed)))
    if extra:
        raise DigestMismatch(f"{folder}: files not in manifest: {extra[:5]}")
    body = {k: m[k] for k in ("stage", "files", "parents", "config_digest", "code_digest")}
    if sha256_json(body) != m["sha256"]:
        raise DigestMismatch(f"{folder}: manifest content does not hash to its recorded digest")
    return m


def verify_ref(ref: ArtifactRef) -> dict:
    return verify(ref.path, ref.sha256)


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """Yield a temp folder beside `target`, deleted on exit unless the caller moved it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, replacing an old one (only for caches such as a remote store's local mirror:
    a published artifact is never replaced, see posttrain.pipeline.store.publish_local)."""
    if target.exists():
        old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temp folder; on success rename it to `target` (replacing an old one), else delete it."""
    with staging_dir(target) as tmp:
        yield tmp
        replace_dir(tmp, target)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def find_by_digest(root: Path, digest: str) -> Path | None:
    """The artifact folder under `root` with this digest; one that verifies before one that does not (a
    corrupted version is kept beside its recomputed twin, posttrain.pipeline.store)."""
    found = []
    for m in root.rglob(MANIFEST):
        if ".tmp-" in str(m) or ".old-" in str(m):
            continue
        try:
            if json.loads(m.read_text()).get("sha256") == digest:
                found.append(m.parent)
        except (OSError, ValueError):
            continue
    for folder in found:
        try:
            verify(folder, digest)
            return folder
        except DigestMismatch:
            continue
    return found[0] if found else None
