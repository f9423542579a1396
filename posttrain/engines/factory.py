"""Every engine a stage uses comes from here (see the package docstring)."""
from __future__ import annotations

from pathlib import Path

import torch

from posttrain.engines import registry
from posttrain.engines.base import RolloutEngine, TrainEngine


def supports(cfg, capability: str, kind: str = "train") -> bool:
    """Whether the run's `kind` engine (runtime.train_engine / runtime.rollout_engine) declares `capability`."""
    return registry.supports(kind, getattr(cfg.runtime, f"{kind}_engine"), capability)


def rollout_engine(name: str, checkpoint: str | Path, dtype: str = "float32",
                   keep_in_flight: bool = False) -> RolloutEngine:
    """A rollout engine holding the checkpoint (plain or W4A8 compressed-tensors) in `dtype`; `keep_in_flight`:
    weight updates reach its generations in flight (rl.partial_rollouts), where the engine can."""
    cls = registry.engine_class("rollout", name, "runtime.rollout_engine")
    if not keep_in_flight:
        return cls.from_checkpoint(checkpoint, dtype=dtype)
    if not registry.supports("rollout", name, registry.PARTIAL_ROLLOUTS):
        raise ValueError(f"rl.partial_rollouts: the {name!r} rollout engine cannot take weights mid-generation "
                         f"(engines that can: {registry.names('rollout', registry.PARTIAL_ROLLOUTS)})")
    return cls.from_checkpoint(checkpoint, dtype=dtype, keep_in_flight=True)


def train_engine(name: str, checkpoint: str | Path, role: str = "policy", *, lr: float | None = None,
                 moe=None, routing_replay: bool = False, **options) -> TrainEngine:
    """A train engine for the checkpoint as `policy`, `critic` (a value head on its backbone) or `reference`
    (forward only); `moe`: the MoEConfig a policy with routers trains under; `routing_replay`: a policy scores
    samples through the experts their rollout chose (posttrain.routing_replay); `options`: the engine's own
    (`train_options`)."""
    kw = {"routing_replay": True} if routing_replay else {}  # an engine without replay is never asked for it
    cls = registry.engine_class("train", name, "runtime.train_engine")
    return cls.from_checkpoint(checkpoint, role, lr=lr, moe=moe, **kw, **options)


def lm_engine(cfg, model: torch.nn.Module | None, tok, checkpoint: str | Path | None = None, *, lr: float,
              weight_decay: float = 0.0, moe=None, mtp_weight: float = 0.0, dsa_weight: float = 0.0,
              indexers: tuple | None = None, recompute: bool = False, cp: int | None = None,
              prepare=None, engine: str | None = None, stage: str = "") -> TrainEngine:
    """The run's train engine (runtime.train_engine) on the LM loss of base, the ramp or sft, starting from `model`
    (`checkpoint`: the folder it was loaded from, where an engine reads weights itself; no model: the engine loads
    `checkpoint`). `moe`: balance its routers;
    `mtp_weight`: its draft (MTP) layer's loss beside the LM loss; `dsa_weight`: DSA's indexers' KL beside it;
    `indexers`: (mode, kl_queries, kl_weight) while DSA is adopted ("warmup": the indexers alone, toward the dense
    attention); `recompute`: activation checkpointing; `cp`: a ramp rung's context-parallel ranks; `prepare`: readies
    a module for Ray Train's ranks (DDP); `engine`: another engine than the run's; `stage`: the stage, for its LoRA
    adapters (lora.stages). `close()` the engine when done: it undoes what the job set on `model`."""
    name = engine or cfg.runtime.train_engine
    options = train_options(cfg) | lora_options(cfg, stage) if name == cfg.runtime.train_engine else {}
    recompute = recompute or options.pop("recompute", False)  # the engine's own setting, or the stage's
    return registry.engine_class("train", name, "runtime.train_engine").for_lm(
        model, tok, checkpoint, lr=lr, weight_decay=weight_decay, moe=moe, mtp_weight=mtp_weight,
        dsa_weight=dsa_weight, indexers=indexers, recompute=recompute, cp=cp, prepare=prepare, seed=cfg.seed,
        **options)


def train_options(cfg) -> dict:
    """The keyword options of `cfg.runtime.train_engine`'s engine from the config (megatron: its split over ranks)."""
    ref = registry.spec("train", cfg.runtime.train_engine).options
    return registry.load(ref)(cfg) if ref else {}


def lora_options(cfg, stage: str) -> dict:
    """The `lora` keyword of a LORA engine's policy in `stage` (sft, rl, opd) when lora.stages names it."""
    if not cfg.lora.used(stage):
        return {}
    from posttrain.engines.lora import Lora  # peft: only where adapters are trained
    settings = cfg.lora
    targets = settings.targets if isinstance(settings.targets, str) else tuple(settings.targets)
    return {"lora": Lora(settings.rank, settings.alpha, targets)}


def rollout_options(cfg) -> dict:
    """What generates in the RL loop and how the trainer's weights reach it (train_policy's keywords)."""
    return {"rollout_engine": cfg.runtime.rollout_engine, "weight_sync": cfg.runtime.weight_sync}


def as_rollout_engine(model, tokenizer) -> RolloutEngine:
    """A model in this process as a rollout engine (an engine is returned as it is)."""
    if isinstance(model, torch.nn.Module):
        return registry.engine_class("rollout", "torch")(model, tokenizer)
    return model


def check(names: dict[str, str]) -> None:
    """Refuse unknown engine names before any work ({config key: name})."""
    for key, name in names.items():
        registry.spec("rollout" if key.endswith("rollout_engine") else "train", name, key)
