"""Engines: the seam between the pipeline's algorithms and what runs the model.

A `RolloutEngine` (posttrain/engines/base.py) generates from token ids with per-token logprobs and stop
reasons, scores given tokens (teachers), takes new weights with a version and can pause; rollout workers,
teachers, validation and every evaluation generate through one. A `TrainEngine` runs forward in the
completion layout, backward, the optimizer step and its state (weights, optimizer, RNG) for the RL policy,
the PPO critic and the KL reference. `runtime.rollout_engine` and `runtime.train_engine` pick one by name; adding a
backend is one module and one line in `registry.py`'s ROLLOUT / TRAIN, where each engine's capabilities are declared.
Every stage gets its engine here: `lm_engine` for the LM loss of base, the ramp and sft, `train_engine` for RL and
OPD, `rollout_engine` for generation; `registry.ranks` says over how many ranks a stage's engine trains.

- torch (both): the model in this process (CPU or one GPU; DDP under Ray Train for sft).
- megatron (train, `engines/megatron/`): megatron-core, weights through mbridge, split over tp x pp x cp x ep ranks
  (sft's Ray Train workers, a ramp rung's, RL and OPD's Ray actors: `rl/ranks.py`); the facade in `engine`, its parts
  beside it: `layout` (the split, mbridge), `forward`, `lm` (the LM loss and 1F1B micro-batches), `optimizer` (grad
  sync, clipping, a distributed optimizer of its own), `state` (resume shards through `dist_checkpointing`),
  `pipeline_stages`, `context_parallel`, `vocab_parallel`, GLM-5 in Megatron's latent attention and MoE layers
  (`glm5`), its DSA indexers in the core attention (`dsa`), a draft (MTP) layer beside the LM loss (`mtp`); `rules`
  holds its config rules and layout, read without megatron-core. Still to come: Megatron's DDP on CUDA
  (docs/megatron.md).
- sglang (rollout, `engines/sglang_rollout.py`): each worker, teacher and evaluated checkpoint served by its own
  SGLang server process (`engines/sglang_server.py`; SGLang's environment from `make sglang`); updates that reach
  generations in flight (rl.partial_rollouts) and the trainer's broadcast to every server (`engines/weight_group.py`).
"""
import importlib

# Lazy (PEP 562): the config imports posttrain.engines.registry before any work, and importing this package must not
# import torch for it (the CLI's --help and argument errors stay fast).
_PUBLIC = {"Generation": "base", "RolloutEngine": "base", "TrainEngine": "base", "rollout_engine": "factory",
           "train_engine": "factory", "lm_engine": "factory", "as_rollout_engine": "factory",
           "train_options": "factory", "lora_options": "factory", "rollout_options": "factory", "supports": "factory",
           "check": "factory"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'posttrain.engines' has no attribute {name!r}")
    return getattr(importlib.import_module(f"posttrain.engines.{_PUBLIC[name]}"), name)
