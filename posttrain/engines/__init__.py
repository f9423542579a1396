"""Engines: the seam between the pipeline's algorithms and what runs the model.

A `RolloutEngine` (posttrain/engines/base.py) generates from token ids with per-token logprobs and stop
reasons, scores given tokens (teachers), takes new weights with a version and can pause; rollout workers,
teachers, validation and every evaluation generate through one. A `TrainEngine` runs forward in the
completion layout, backward, the optimizer step and its state (weights, optimizer, RNG) for the RL policy,
the PPO critic and the KL reference. `runtime.rollout_engine` and `runtime.train_engine` pick one by name; adding a
backend is one module and one line in ROLLOUT / TRAIN below.

- torch (both): the model in this process (CPU or one GPU; DDP under Ray Train for sft).
- megatron (train, `engines/megatron_train.py`): megatron-core, weights through mbridge, split over tp x pp x cp x ep
  ranks (sft's Ray Train workers, a ramp rung's, RL and OPD's Ray actors: `rl/ranks.py`); GLM-5 in Megatron's latent
  attention and MoE layers (`megatron_glm5`), its DSA indexers in the core attention (`megatron_dsa`), a draft
  (MTP) layer beside the LM loss (`megatron_mtp`); sft resumes from `dist_checkpointing`; `megatron_memory` says what
  a layout holds per GPU; a distributed optimizer of its own (`zero_optimizer`) and the 1F1B schedule for sft's and
  the ramp's LM loss and RL's micro-batches (`pipeline_stages`). Still to come: Megatron's DDP on CUDA
  (docs/megatron.md).
- sglang (rollout, `engines/sglang_rollout.py`): each worker, teacher and evaluated checkpoint served by its own
  SGLang server process (`engines/sglang_server.py`; SGLang's environment from `make sglang`); updates that reach
  generations in flight (rl.partial_rollouts) and the trainer's broadcast to every server (`engines/weight_group.py`).
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from posttrain.engines.base import Generation, RolloutEngine, TrainEngine

__all__ = ["Generation", "RolloutEngine", "TrainEngine", "rollout_engine", "train_engine", "as_rollout_engine",
           "train_options", "rollout_options"]

ROLLOUT = {"torch": "posttrain.engines.torch_rollout:TorchRolloutEngine",
           "sglang": "posttrain.engines.sglang_rollout:SGLangRolloutEngine"}
TRAIN = {"torch": "posttrain.engines.torch_train:TorchTrainEngine",
         "megatron": "posttrain.engines.megatron_train:MegatronTrainEngine"}


def _cls(table: dict[str, str], name: str, key: str):
    if name not in table:
        raise ValueError(f"{key}: unknown engine {name!r} (known: {', '.join(sorted(table))})")
    module, attr = table[name].split(":")
    return getattr(importlib.import_module(module), attr)


def rollout_engine(name: str, checkpoint: str | Path, dtype: str = "float32",
                   keep_in_flight: bool = False) -> RolloutEngine:
    """A rollout engine holding the checkpoint (plain or W4A8 compressed-tensors) in `dtype`; `keep_in_flight`:
    weight updates reach its generations in flight (rl.partial_rollouts), where the engine can."""
    cls = _cls(ROLLOUT, name, "runtime.rollout_engine")
    if not keep_in_flight:
        return cls.from_checkpoint(checkpoint, dtype=dtype)
    if not getattr(cls, "KEEPS_IN_FLIGHT", False):
        raise ValueError(f"rl.partial_rollouts: the {name!r} rollout engine cannot take weights mid-generation "
                         f"(use runtime.rollout_engine sglang)")
    return cls.from_checkpoint(checkpoint, dtype=dtype, keep_in_flight=True)


def train_engine(name: str, checkpoint: str | Path, role: str = "policy", *, lr: float | None = None,
                 moe=None, routing_replay: bool = False, **options) -> TrainEngine:
    """A train engine for the checkpoint as `policy`, `critic` (a value head on its backbone) or `reference`
    (forward only); `moe`: the MoEConfig a policy with routers trains under; `routing_replay`: a policy scores
    samples through the experts their rollout chose (posttrain.routing_replay); `options`: the engine's own
    (`train_options`)."""
    kw = {"routing_replay": True} if routing_replay else {}  # an engine without replay is never asked for it
    return _cls(TRAIN, name, "runtime.train_engine").from_checkpoint(checkpoint, role, lr=lr, moe=moe, **kw,
                                                                     **options)


def train_options(cfg) -> dict:
    """The keyword options of `cfg.runtime.train_engine`'s engine (megatron: its split over ranks)."""
    if cfg.runtime.train_engine != "megatron":
        return {}
    from posttrain.engines.megatron_setup import Parallel
    m = cfg.megatron
    return {"parallel": Parallel(m.tp, m.pp, m.cp, m.ep, m.sequence_parallel), "recompute": m.recompute,
            "distributed_optimizer": m.distributed_optimizer, "micro_batches": m.micro_batches}


def rollout_options(cfg) -> dict:
    """What generates in the RL loop and how the trainer's weights reach it (train_policy's keywords)."""
    return {"rollout_engine": cfg.runtime.rollout_engine, "weight_sync": cfg.runtime.weight_sync}


def as_rollout_engine(model, tokenizer) -> RolloutEngine:
    """A model in this process as a rollout engine (an engine is returned as it is)."""
    if isinstance(model, torch.nn.Module):
        from posttrain.engines.torch_rollout import TorchRolloutEngine
        return TorchRolloutEngine(model, tokenizer)
    return model


def check(names: dict[str, str]) -> None:
    """Refuse unknown engine names before any work ({config key: name})."""
    for key, name in names.items():
        _cls(ROLLOUT if key.endswith("rollout_engine") else TRAIN, name, key)
