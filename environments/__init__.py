"""Verifiable environments. Add one by writing a module with `generate(split, n, seed, **knobs)` and
`verify(task, completion) -> (score, reason)`, then naming it in REGISTRY (or `register`)."""
from __future__ import annotations

import importlib
from types import ModuleType

REGISTRY: dict[str, str] = {
    "reasoning": "environments.reasoning",
    "agentic": "environments.agentic",
    "general": "environments.general",
    "long_context": "environments.long_context",
}
DOMAINS = ("reasoning", "agentic", "general")


def register(name: str, module: str) -> None:
    REGISTRY[name] = module


def names(extra: dict[str, str] | None = None) -> list[str]:
    """The task domains of a run: the built-in three plus the config's own environments."""
    for name, module in (extra or {}).items():
        register(name, module)
    return [*DOMAINS, *(extra or {})]


def get(name: str) -> ModuleType:
    if name not in REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])
