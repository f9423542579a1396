"""Code digests for cache keys: the source of a module and every project module it imports.

Flyte's `cache="auto"` hashes only a task function's body, so a changed helper gives a stale cache
hit. Hashing the transitive closure of project imports invalidates exactly the stages that use it.
Environments are loaded by name (environments.REGISTRY, a profile's `world.environments`), which no
import statement shows, so `stage_code_digest` adds them for every stage that can load them.
"""
from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from importlib.machinery import PathFinder
from pathlib import Path

from posttrain.config import ROOT, ConfigError, PipelineConfig

PROJECT_PACKAGES = ("posttrain", "environments", "kernels")


def _module_file(name: str, roots: tuple[str, ...] = ()) -> Path | None:
    """Source file of a project module, or of a module under one of `roots` (a user's own packages)."""
    parts = name.split(".")
    if parts[0] in PROJECT_PACKAGES:
        base = ROOT.joinpath(*parts)
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.exists():
                return cand
        return None
    return _find_on_path(name) if parts[0] in roots else None


def _find_on_path(name: str) -> Path | None:
    # PathFinder, one level at a time, finds what `import` would without running any package's __init__
    parts, search, spec = name.split("."), None, None
    for i in range(len(parts)):
        if i and search is None:
            return None  # a plain module has no submodules
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None


def _imports(path: Path, modname: str) -> frozenset[str]:
    return _parsed_imports(path.read_text(), str(path), modname)


@lru_cache(maxsize=None)
def _parsed_imports(source: str, filename: str, modname: str) -> frozenset[str]:
    # keyed on the source itself (an edited file is parsed again): every stage's closure shares most files, and
    # parsing them once per stage was 5 s of each `posttrain run` on 2 cores
    tree = ast.parse(source, filename=filename)
    path = Path(filename)
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
    return frozenset(found)


@lru_cache(maxsize=None)
def module_closure(name: str, roots: tuple[str, ...] = ()) -> tuple[str, ...]:
    seen: dict[str, Path] = {}
    todo = [name]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        path = _module_file(mod, roots)
        if path is None:
            continue
        seen[mod] = path
        todo.extend(_imports(path, mod))
    return tuple(sorted(seen))


def _digest(files: dict[str, Path]) -> str:
    h = hashlib.sha256()
    for mod in sorted(files):
        h.update(mod.encode())
        h.update(files[mod].read_bytes())
    return h.hexdigest()


def _closure_files(modules: list[str], roots: tuple[str, ...] = ()) -> dict[str, Path]:
    return {m: _module_file(m, roots) for name in modules for m in module_closure(name, roots)}


def code_digest(*modules: str) -> str:
    return _digest(_closure_files(list(modules)))


def registered_environments() -> dict[str, str]:
    """environments.REGISTRY as written in its source: the live dict also holds whatever profiles this
    process registered, which would make one stage's key depend on another run's config."""
    path = ROOT / "environments" / "__init__.py"
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "REGISTRY" for t in targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path}: no literal REGISTRY dict to hash the registered environments from")


def stage_code_digest(module: str, cfg: PipelineConfig) -> str:
    """`code_digest(module)`, plus every environment the module can load by name when its closure holds
    the registry: the registered ones and `cfg.world.environments`, each with its own imports."""
    if "environments" not in module_closure(module):
        return code_digest(module)
    user = cfg.world.environments
    roots = tuple(sorted({m.split(".")[0] for m in user.values()} - set(PROJECT_PACKAGES)))
    files = _closure_files([module, *registered_environments().values()], roots)
    for name, mod in sorted(user.items()):
        path = _module_file(mod, roots)
        if path is None:
            raise ConfigError(f"world.environments.{name}: module {mod!r} not found (not in this repo's packages "
                              f"nor on sys.path; add its folder to PYTHONPATH), so its code cannot enter the cache key")
        files.update(_closure_files([mod], roots))
        if path.name == "__init__.py":  # a package may load its submodules dynamically: take them all
            for p in sorted(path.parent.rglob("*.py")):
                files[".".join([mod, *p.relative_to(path.parent).with_suffix("").parts])] = p
    return _digest(files)
