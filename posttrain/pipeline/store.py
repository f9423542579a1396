"""The artifact store: POSTTRAIN_HOME (or `storage.root`) is a local folder or any fsspec URL (s3://, gs://,
abfs://, ...). With a URL, every node works in a local mirror (`home_dir()`) and the store is the truth:

  <root>/artifacts/<stage>/<key16>/<version>/...   the files, manifest.json uploaded last
  <root>/artifacts/<stage>/<key16>/COMMIT          {"version", "sha256"}: one PUT that makes it visible
  <root>/runs/<run_id>/...                          report.json, config.json, report.html and plots
  <root>/latest/report.json
  <root>/scratch/<stage>/<key16>/...                a resumable stage's last checkpoint, SNAPSHOT last (sft: Ray
                                                    Train's own checkpoint folder)

A half-uploaded artifact has no COMMIT (or an older one), so no consumer ever sees it; a consumer downloads
the committed version into its mirror and verifies every file against the manifest before using it.
Object stores have no rename, hence the commit object instead of the local store's atomic folder rename.

Nothing published is ever replaced, so every registered model's lineage stays verifiable:
- Two runs that compute the same node at once: the first publication wins (a local folder is claimed by an
  atomic rename onto a free name; a COMMIT object by a conditional PUT, If-None-Match: *), and the other run
  takes the winner's artifact instead of its own.
- A cache entry that fails verification is reported by name and kept as evidence; the recomputed result goes
  to the next version: `<key16>.2`, `.3`, ... locally, `COMMIT.2`, `.3`, ... in an object store.
A cache lookup serves the newest version that verifies.
"""
from __future__ import annotations

import errno
import hashlib
import importlib
import itertools
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from posttrain.pipeline.artifacts import MANIFEST, ArtifactRef, DigestMismatch, atomic_dir, sha256_json, verify

COMMIT = "COMMIT"
SNAPSHOT = "SNAPSHOT"
# the store URL of a running resumable stage's scratch; set in the stage's Ray runtime_env by execute, so the
# stage and every task and actor it starts (Ray Train workers) can reach it
SCRATCH_VAR = "POSTTRAIN_SCRATCH_URL"


def root_uri() -> str:
    """POSTTRAIN_HOME as given: a URL, or a local folder (default ./.posttrain) made absolute."""
    raw = os.environ.get("POSTTRAIN_HOME", "")
    return raw.rstrip("/") if is_url(raw) else str(Path(raw or Path.cwd() / ".posttrain").resolve())


def is_url(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def home_dir() -> Path:
    """Where this process works: the store itself when it is local, else a local mirror of the URL
    (POSTTRAIN_LOCAL, default ~/.cache/posttrain/<hash of the URL>)."""
    root = root_uri()
    if not is_url(root):
        return Path(root)
    local = os.environ.get("POSTTRAIN_LOCAL") or Path.home() / ".cache" / "posttrain" / \
        hashlib.sha256(root.encode()).hexdigest()[:16]
    return Path(local).resolve()


class Store:
    """A remote store at `root` (an fsspec URL), mirrored under `local`."""

    def __init__(self, root: str, local: Path):
        self.root, self.local = root.rstrip("/"), local
        self.fs, self.base = _filesystem(self.root)
        self.fs.invalidate_cache()  # fsspec shares instances per process: listings another process changed

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _path(self, rel: str) -> str:
        return f"{self.base.rstrip('/')}/{rel}"

    def _rel(self, uri: str) -> str:
        if not uri.startswith(self.root + "/"):
            raise DigestMismatch(f"{uri}: not in the store {self.root}")
        return uri[len(self.root) + 1:]

    # small files: run reports and configs
    def put_text(self, rel: str, text: str) -> None:
        with self.fs.open(self._path(rel), "w") as f:
            f.write(text)

    def create_text(self, rel: str, text: str) -> bool:
        """Write `rel` only if it does not exist (a conditional PUT, If-None-Match: *); False if it did. A filesystem
        whose fsspec implementation has no exclusive create falls back to look-then-write, which two writers in the
        same second can both pass (publication then still converges: each reader serves one committed version)."""
        try:
            self.fs.pipe_file(self._path(rel), text.encode(), mode="create")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):
            if self.fs.exists(self._path(rel)):
                return False
            self.put_text(rel, text)
            return True

    def get_text(self, rel: str) -> str | None:
        try:
            with self.fs.open(self._path(rel), "r") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put_dir(self, local: Path, rel: str, last: str = "") -> None:
        """Upload every file under `local` to `rel/`, the file named `last` after all others."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        for p in sorted(files, key=lambda p: p.name == last):
            self.fs.put_file(str(p), self._path(f"{rel}/{p.relative_to(local).as_posix()}"))

    # artifacts
    def _commits(self, stage: str, key: str) -> Iterator[str]:
        return (f"artifacts/{stage}/{key[:16]}/{COMMIT}" + (f".{n}" if n > 1 else "") for n in itertools.count(1))

    def publish(self, folder: Path, stage: str, key: str, sha256: str, skip: frozenset[str] = frozenset()
                ) -> tuple[str, str]:
        """Upload a finished local artifact (manifest last), then commit it with a conditional PUT on the first
        free COMMIT name. Returns (URI, sha256) of the published version: ours, or the one another run committed
        first (then ours is deleted). `skip`: commit names the caller already judged (corrupted, or forced past)."""
        rel = f"artifacts/{stage}/{key[:16]}"
        version = f"{sha256[:16]}-{uuid.uuid4().hex[:8]}"
        try:
            self.put_dir(folder, f"{rel}/{version}", last=MANIFEST)
            for name in self._commits(stage, key):
                if self.create_text(name, json.dumps({"version": version, "sha256": sha256})):
                    return self.url(f"{rel}/{version}"), sha256
                if name in skip:
                    continue
                try:  # another run committed this key first: its artifact is the one
                    uri, sha = self._commit(name)
                    self.manifest(uri, sha)
                except DigestMismatch:
                    continue
                self.fs.rm(self._path(f"{rel}/{version}"), recursive=True)
                return uri, sha
        except Exception as e:  # the store went away mid-upload (s3fs and botocore raise many kinds)
            raise OSError(f"publishing {stage} to {self.url(rel)} failed ({type(e).__name__}: {e}); nothing was "
                          f"committed, so no consumer sees a partial upload. The finished artifact stays in "
                          f"{folder}: rerun once the store answers and it is published from there") from e
        raise AssertionError("unreachable")

    def _commit(self, name: str) -> tuple[str, str]:
        c = json.loads(self.get_text(name) or "{}")
        if "version" not in c:
            raise DigestMismatch(f"{self.url(name)}: not a commit record")
        return self.url(f"{name.rsplit('/', 1)[0]}/{c['version']}"), c["sha256"]

    def committed(self, stage: str, key: str) -> "Versions":
        """Every committed version of `stage` at cache key `key`, judged by its manifest (whoever consumes it
        downloads and verifies every file)."""
        out = Versions()
        for name in self._commits(stage, key):
            if not self.fs.exists(self._path(name)):
                return out
            out.seen.add(name)
            try:
                uri, sha = self._commit(name)
                out.valid = (uri, self.manifest(uri, sha))
            except DigestMismatch as e:
                out.corrupted.append(str(e))
        raise AssertionError("unreachable")

    def manifest(self, uri: str, sha256: str) -> dict:
        """The manifest of the artifact at `uri`, checked to be the one with digest `sha256`."""
        text = self.get_text(f"{self._rel(uri)}/{MANIFEST}")
        if text is None:
            raise DigestMismatch(f"{uri}: no {MANIFEST} in the store")
        try:
            m = json.loads(text)
            body = {k: m[k] for k in ("stage", "files", "parents", "config_digest", "code_digest")}
        except (ValueError, KeyError, TypeError):
            m, body = {}, None
        if m.get("sha256") != sha256 or sha256_json(body) != sha256:
            raise DigestMismatch(f"{uri}/{MANIFEST}: does not hash to the committed digest {sha256[:12]}")
        return m

    def mirror(self, uri: str) -> Path:
        """The local mirror folder of an artifact URI (artifacts/<stage>/<key16>)."""
        parts = self._rel(uri).split("/")
        return self.local.joinpath(*parts[:3])

    def fetch(self, uri: str, sha256: str) -> Path:
        """The artifact at `uri` in the local mirror, downloaded if the mirror lacks it, verified."""
        target = self.mirror(uri)
        try:
            if verify(target, sha256):
                return target
        except DigestMismatch:
            pass  # absent, stale or tampered locally: take the store's
        src = self._path(self._rel(uri))
        if not self.fs.exists(f"{src}/{MANIFEST}"):
            raise DigestMismatch(f"{uri}: no {MANIFEST} in the store (not committed, or deleted)")
        with atomic_dir(target) as tmp:
            for path in self.fs.find(src):
                dest = tmp / path[len(src) + 1:]
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(path, str(dest))
            try:
                verify(tmp, sha256)
            except DigestMismatch as e:  # name the object, not the temp folder
                raise DigestMismatch(str(e).replace(str(tmp), uri)) from None
        return target

    def find_by_digest(self, sha256: str) -> str | None:
        """The committed artifact with this digest; one whose manifest checks out first."""
        found = []
        for commit in self.fs.glob(self._path(f"artifacts/*/*/{COMMIT}*")):
            try:
                uri, sha = self._commit(commit[len(self.base.rstrip("/")) + 1:])
            except (DigestMismatch, ValueError):
                continue
            if sha == sha256:
                found.append(uri)
        for uri in found:
            try:
                self.manifest(uri, sha256)
                return uri
            except DigestMismatch:
                continue
        return found[0] if found else None


@dataclass
class Versions:
    """What a cache lookup found for one key: the newest version that verifies (URI, manifest), the names it
    looked at, and what was wrong with the ones that did not verify."""
    valid: tuple[str, dict] | None = None
    seen: set[str] = field(default_factory=set)
    corrupted: list[str] = field(default_factory=list)


def _slots(target: Path) -> Iterator[Path]:
    return (target if n == 1 else target.with_name(f"{target.name}.{n}") for n in itertools.count(1))


def local_versions(target: Path) -> Versions:
    """Every version of a local store's artifact folder `target` (`target`, `target.2`, ...), each verified."""
    out = Versions()
    for slot in _slots(target):
        if not slot.exists():
            return out
        out.seen.add(str(slot))
        try:
            out.valid = (str(slot), verify(slot))
        except DigestMismatch as e:
            out.corrupted.append(str(e))
    raise AssertionError("unreachable")


def publish_local(tmp: Path, target: Path, skip: frozenset[str] = frozenset()) -> Path:
    """Move the finished artifact folder `tmp` onto the first free version name of `target` (a rename onto a
    name that exists fails, so of two runs the first wins). A version that appeared since the caller looked
    (`skip`: the ones it saw) and verifies was published by a run computing the same node: it is returned and
    `tmp` deleted. Returns the published folder."""
    for slot in _slots(target):
        if not slot.exists():
            try:
                os.rename(tmp, slot)
                return slot
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        if str(slot) in skip:
            continue
        try:
            verify(slot)
        except DigestMismatch:
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        return slot
    raise AssertionError("unreachable")


def _filesystem(root: str):
    """fsspec's own implementation for the URL's protocol (s3fs, gcsfs, adlfs, ...): Flyte registers its
    obstore-based filesystem for s3:// in-process, which this store does not rely on."""

    from fsspec.registry import known_implementations  # fsspec's backends: only for a remote store
    protocol = root.split("://", 1)[0]
    impl = known_implementations.get(protocol)
    if impl is None:
        import fsspec  # fsspec's backends: only for a remote store
        return fsspec.core.url_to_fs(root)
    module, _, name = impl["class"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError:
        raise ImportError(f"POSTTRAIN_HOME={root}: {impl.get('err') or f'install {module}'}") from None
    return cls(), cls._strip_protocol(root)


def store() -> Store | None:
    """The remote store of this process's POSTTRAIN_HOME (None: a local one)."""
    root = root_uri()
    return Store(root, home_dir()) if is_url(root) else None


def local_path(ref: ArtifactRef | str, sha256: str = "") -> Path:
    """An artifact as a local folder (downloaded and verified when the store is remote)."""
    uri, sha = (ref.path, ref.sha256) if isinstance(ref, ArtifactRef) else (ref, sha256)
    s = store() if is_url(uri) else None
    return s.fetch(uri, sha) if s else Path(uri)


def upload_run(run_dir: Path, run_id: str) -> None:
    """A finished run's folder to the store (report.json last) and the `latest` pointer."""
    s = store()
    if s is None:
        return
    s.put_dir(run_dir, f"runs/{run_id}", last="report.json")
    s.put_text("latest/report.json", (run_dir / "report.json").read_text())


def upload_failed_run(run_dir: Path, run_id: str, partial: str) -> None:
    """A failed run's config and finished stages (`partial`, a file name in run_dir) to the store, so that
    `posttrain rerun --from` it works from any machine of the store."""
    s = store()
    if s is None:
        return
    for name in ("config.json", partial):
        s.put_text(f"runs/{run_id}/{name}", (run_dir / name).read_text())


def download_run(run: str) -> None:
    """An earlier run's report and config into the local mirror (`latest` resolved), when the store is remote."""
    s = store()
    if s is None:
        return
    if run == "latest":
        text = s.get_text("latest/report.json")
        if text is None:
            return
        run = json.loads(text)["run_id"]
        (s.local / "latest").mkdir(parents=True, exist_ok=True)
        (s.local / "latest" / "report.json").write_text(text)
    for name in ("report.json", "config.json", "partial.json"):  # partial.json: a failed run's finished stages
        text = s.get_text(f"runs/{run}/{name}")
        if text is not None:
            (s.local / "runs" / run).mkdir(parents=True, exist_ok=True)
            (s.local / "runs" / run / name).write_text(text)


_PUSHED: dict[tuple[str, str], tuple[int, int]] = {}  # (url, relative path) -> (size, mtime_ns) uploaded


def checkpointed(scratch: str | Path) -> None:
    """Call right after a complete resume checkpoint is written into `scratch`: against a remote store, its
    changed files are uploaded, then SNAPSHOT (the list of current files) that makes it the one a stage
    resumed on another machine starts from. No-op with a local store."""
    url = os.environ.get(SCRATCH_VAR)
    if not url:
        return
    fs, base = _filesystem(url)
    local = Path(scratch)
    files = {p.relative_to(local).as_posix(): p for p in sorted(local.rglob("*")) if p.is_file()}
    for rel, p in files.items():
        st = p.stat()
        if _PUSHED.get((url, rel)) != (st.st_size, st.st_mtime_ns):
            fs.put_file(str(p), f"{base}/{rel}")
            _PUSHED[(url, rel)] = (st.st_size, st.st_mtime_ns)
    fs.pipe_file(f"{base}/{SNAPSHOT}", json.dumps(sorted(files)).encode())


def restore_scratch(scratch: str | Path) -> bool:
    """Before a resumable stage starts: fill an empty local `scratch` from the store's last snapshot (a stage
    lost with its machine resumes on another). True if something was restored."""
    url, local = os.environ.get(SCRATCH_VAR), Path(scratch)
    if not url or (local.exists() and any(local.iterdir())):
        return False
    fs, base = _filesystem(url)
    try:
        names = json.loads(fs.cat_file(f"{base}/{SNAPSHOT}"))
    except FileNotFoundError:
        return False
    for rel in names:
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{base}/{rel}", str(local / rel))
    print(f"[store] restored {len(names)} scratch files from {url}", flush=True)
    return True


def train_storage(scratch: str) -> tuple[str, object]:
    """(storage_path, storage_filesystem) for Ray Train's checkpoints: with a remote store, its scratch URL for
    this stage through the store's own filesystem (Ray Train writes and restores its checkpoints there, so a pod
    lost mid-stage resumes on another); else the local `scratch` folder and Ray Train's default."""
    url = os.environ.get(SCRATCH_VAR)
    if not url:
        return str(Path(scratch).resolve()), None
    from pyarrow.fs import FSSpecHandler, PyFileSystem  # pyarrow's filesystem: only for a remote store
    fs, base = _filesystem(url)
    return base, PyFileSystem(FSSpecHandler(fs))


def drop_scratch(url: str) -> None:
    """The stage published: its resume state in the store is no longer needed."""
    fs, base = _filesystem(url)
    if fs.exists(base):
        fs.rm(base, recursive=True)
