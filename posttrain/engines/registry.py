"""Which engines exist and what each can do: the one declaration that the config's rules, the factory
(posttrain.engines) and the stages read. Light on purpose (no torch): the config imports it to check a run before
any work.

Adding an engine is one module (its class) and one line in TRAIN or ROLLOUT below. An engine's capabilities are
what it can do beyond its Protocol (posttrain.engines.base); a stage or a config rule asks `supports`, never the
engine's name, never `hasattr`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# train engines
ROUTING_REPLAY = "routing_replay"    # scores samples through the experts their rollout chose (posttrain.routing_replay)
OWN_INDEXERS = "own_indexers"        # trains posttrain's DSA indexers added to a dense model (ramp.dsa on llama)
ROPE_SCALING = "rope_scaling"        # a ramp rung's rope_scaling (beyond its rope_theta)
CONTEXT_PARALLEL = "context_parallel"  # a ramp rung's sequences split over ranks (ramp.stages[].cp)
SHARDED_STATE = "sharded_state"      # every rank saves its own shards of a resume checkpoint (save_sharded)
# rollout engines
ROUTING_RECORD = "routing_record"    # returns the experts each position ran through (Generation.routes)
PARTIAL_ROLLOUTS = "partial_rollouts"  # takes weights while generations are in flight (rl.partial_rollouts)
WEIGHT_BROADCAST = "weight_broadcast"  # joins the trainer's process group for weight updates (weight_sync broadcast)
INT_KERNELS = "int_kernels"          # runs a W4A8 compressed-tensors checkpoint on posttrain's integer kernels
LORA = "lora"                        # trains LoRA adapters and hands out merged weights (lora.rank > 0)

# where an engine's own processes (a server) write their logs: the stage sets it to its folder beside the run's report
LOG_DIR_VAR = "POSTTRAIN_ENGINE_LOG_DIR"


@dataclass(frozen=True)
class Engine:
    """One engine: `cls` ("module:Class", imported on first use), its capabilities, and optionally `options`
    ("module:function", cfg -> the class's keyword options from the config) and `rules` ("module:function",
    cfg -> the config errors of what the engine refuses, each starting with the key to change; a light module).
    A train engine's class has `from_checkpoint` (RL and OPD) and `for_lm` (base, the ramp, sft)."""
    cls: str
    can: frozenset[str]
    options: str = ""
    rules: str = ""
    ranks: str = ""      # "module:function", (cfg, stage, cp) -> ranks; none: sft.workers for sft, else one
    checkpoint_rules: str = ""  # "module:function", (cfg, hf_config, where) -> errors against base.init_from's shapes
    section: str = ""    # the config section of the engine's own settings (part of the cache key of what it trains)


TRAIN: dict[str, Engine] = {
    "torch": Engine("posttrain.engines.torch_train:TorchTrainEngine",
                    frozenset({ROUTING_REPLAY, OWN_INDEXERS, ROPE_SCALING, LORA})),
    "megatron": Engine("posttrain.engines.megatron.engine:MegatronTrainEngine",
                       frozenset({ROUTING_REPLAY, CONTEXT_PARALLEL, SHARDED_STATE}),
                       options="posttrain.engines.megatron.rules:options",
                       rules="posttrain.engines.megatron.rules:errors",
                       ranks="posttrain.engines.megatron.rules:ranks", section="megatron",
                       checkpoint_rules="posttrain.engines.megatron.rules:checkpoint_errors"),
}
ROLLOUT: dict[str, Engine] = {
    "torch": Engine("posttrain.engines.torch_rollout:TorchRolloutEngine", frozenset({ROUTING_RECORD, INT_KERNELS})),
    "sglang": Engine("posttrain.engines.sglang_rollout:SGLangRolloutEngine",
                     frozenset({PARTIAL_ROLLOUTS, WEIGHT_BROADCAST})),
}


def spec(kind: str, name: str, key: str = "") -> Engine:
    """The declaration of a `kind` ("train" or "rollout") engine; an unknown name is refused naming `key`."""
    table = TRAIN if kind == "train" else ROLLOUT
    if name not in table:
        raise ValueError(f"{key or f'runtime.{kind}_engine'}: unknown engine {name!r} (known: {', '.join(sorted(table))})")
    return table[name]


def supports(kind: str, name: str, capability: str) -> bool:
    return capability in spec(kind, name).can


def load(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def engine_class(kind: str, name: str, key: str = "") -> type:
    return load(spec(kind, name, key).cls)


def names(kind: str, capability: str) -> str:
    """The engines of `kind` that declare `capability`, for a message."""
    table = TRAIN if kind == "train" else ROLLOUT
    return ", ".join(sorted(n for n, e in table.items() if capability in e.can)) or "none"


def ranks(cfg, stage: str, cp: int | None = None) -> int:
    """The ranks `stage` (sft, or a ramp rung with its `cp`) trains over with the run's train engine: Ray Train
    workers where more than one."""
    ref = spec("train", cfg.runtime.train_engine).ranks
    return load(ref)(cfg, stage, cp) if ref else (cfg.sft.workers if stage == "sft" else 1)


def rules(name: str) -> Callable | None:
    """The train engine's own config rules (cfg -> errors), if it has any."""
    ref = spec("train", name).rules
    return load(ref) if ref else None
