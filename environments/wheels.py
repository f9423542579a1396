"""Benchmark data and checkers that ship in PyPI wheels: the installed files checked against the wheel's RECORD
before anything is scored with them, so a missing or edited package fails naming itself and the fix."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
from pathlib import Path


class BenchmarkPackageError(RuntimeError):
    """A benchmark's package is missing, at another version, or its files do not match its RECORD."""


def package_dir(dist: str, version: str, install: str, under: str) -> Path:
    """The installed folder `under` of distribution `dist`, every file beneath it checked against the RECORD
    hashes the wheel installed (sha256): a missing file, an edited one or another version raises, naming the
    package and the command that installs it."""
    fix = f"install it with: {install}"
    try:
        found = md.version(dist)
    except md.PackageNotFoundError:
        raise BenchmarkPackageError(f"{dist}=={version} is not installed; {fix}") from None
    if found != version:
        raise BenchmarkPackageError(f"{dist} {found} is installed, the benchmark is pinned to {version}; {fix}")
    d = md.distribution(dist)
    # the RECORD itself (importlib.metadata.files leaves out the files that are gone)
    rows = [r for r in csv.reader((d.read_text("RECORD") or "").splitlines())
            if len(r) >= 2 and r[0].startswith(under + "/") and r[1].startswith("sha256=")]
    if not rows:
        raise BenchmarkPackageError(f"{dist}=={version}: its RECORD lists no files under {under}/; {fix}")
    for name, hash_, *_ in rows:
        path = Path(d.locate_file(name))
        if not path.is_file():
            raise BenchmarkPackageError(f"{dist}=={version}: {name} is missing; {fix}")
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        if digest != hash_.removeprefix("sha256="):
            raise BenchmarkPackageError(f"{dist}=={version}: {name} does not match the wheel's RECORD (edited or "
                                        f"corrupt); reinstall it ({install}, with --force-reinstall)")
    return Path(d.locate_file(under))


def tree_digest(root: Path) -> str:
    """sha256 over the files under `root` (names and bytes, in order): the suite's data in its lineage."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
