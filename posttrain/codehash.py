"""Code digests for cache keys: the source of a module and every project module it imports.

Flyte's `cache="auto"` hashes only a task function's body, so a changed helper gives a stale cache
hit. Hashing the transitive closure of project imports invalidates exactly the stages that use it.
"""
from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

from posttrain.config import ROOT

PROJECT_PACKAGES = ("posttrain", "environments", "kernels")


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = ROOT.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _imports(path: Path, modname: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = modname if path.name == "__init__.py" else modname.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    # parent packages' __init__ run on import too
    for m in list(found):
        parts = m.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return found


@lru_cache(maxsize=None)
def module_closure(name: str) -> tuple[str, ...]:
    seen: dict[str, Path] = {}
    todo = [name]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        path = _module_file(mod)
        if path is None:
            continue
        seen[mod] = path
        todo.extend(_imports(path, mod))
    return tuple(sorted(seen))


def code_digest(*modules: str) -> str:
    h = hashlib.sha256()
    for mod in sorted({m for name in modules for m in module_closure(name)}):
        h.update(mod.encode())
        h.update(_module_file(mod).read_bytes())
    return h.hexdigest()
