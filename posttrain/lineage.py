"""Audit: from a registered model version back to the raw corpus, every digest re-verified."""
from __future__ import annotations

from typing import Callable

from mlflow.exceptions import MlflowException

from posttrain import store, tracking
from posttrain.artifacts import DigestMismatch, find_by_digest, verify
from posttrain.config import ConfigError
from posttrain.pipeline import home_dir


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
            m = verify(store.local_path(uri, expected or ""), expected)
        except (DigestMismatch, OSError) as e:
            ok = False
            say(f"{pad}FAILED {e}")
            return
        run = m.get("mlflow_run_id", "")
        say(f"{pad}{m['stage']:13s} sha256 {m['sha256'][:16]}  ok ({len(m['files'])} files)  "
            f"config {m['config_digest'][:10]}  code {m['code_digest'][:10]}  git {m.get('git_sha', '')[:12]}  "
            f"mlflow {run}")
        seen.add(m["sha256"])
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
