"""The megatron engine's state for an exact resume: this rank's own (`state_dict`: its shards, optimizer moments,
schedule and RNG), or a Megatron distributed checkpoint (`save_sharded` / `load_sharded`, dist_checkpointing's
torch_dist format) that every rank writes its shards of and that loads at any tp / pp / cp / ep split.

The draft (MTP) layer and the last stage's copy of an untied embedding (`mtp`) are saved beside the GPTModel's
sharded state: the layer under DRAFT, the copy under the first stage's embedding key, as Megatron saves a tied output
layer (a replica: not written, and loaded from the embedding)."""
from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

from posttrain.engines import optim
from posttrain.engines.megatron import mtp
from posttrain.engines.megatron.optimizer import Optimizer, owned_moment

DRAFT = "draft."  # the draft (MTP) layer's keys in the distributed checkpoint
DRAFT_EMBEDDING = "draft_embedding"  # the last stage's copy of an untied embedding (its key: the first stage's)


def _without_rng(common: dict) -> dict:
    """The common part of a distributed checkpoint as Megatron compares it over ranks before saving rank 0's: without
    the RNG states, which data-parallel ranks draw from on their own (rank 0's are saved; dropout is off, so the
    model's forward draws nothing)."""
    return {**common, "common": {k: v for k, v in common["common"].items() if k not in ("rng", "python_rng")}}


class State:
    """What a resume restores of an engine: `model` (every module it trains: the GPTModel `gpt`, the draft layer's,
    a value head), the `optimizer` (None: a reference, nothing to resume), the draft layer and the embedding copy."""

    def __init__(self, model: nn.Module, gpt, optimizer: Optimizer | None, role: str,
                 draft: mtp.Draft | None = None, draft_copy: nn.Parameter | None = None):
        self.model, self.gpt, self.optimizer, self.role = model, gpt, optimizer, role
        self.draft, self.draft_copy = draft, draft_copy

    @property
    def opt(self) -> torch.optim.Optimizer | None:
        return self.optimizer.opt if self.optimizer else None

    @property
    def sched(self) -> torch.optim.lr_scheduler.LambdaLR | None:
        return self.optimizer.sched if self.optimizer else None

    def state_dict(self) -> dict:
        """This rank's shards, optimizer moments, schedule and RNG (each rank keeps its own)."""
        return optim.training_state(self.model, self.opt, self.sched)

    def load_state_dict(self, state: dict) -> None:
        if "dist_checkpoint" in state:  # sft's checkpoints: a folder of save_sharded
            return self.load_sharded(state["dist_checkpoint"])
        optim.load_training_state(self.model, self.opt, self.sched, state)

    def save_sharded(self, folder: str | Path) -> None:
        """A Megatron distributed checkpoint of the policy in `folder`: weights and AdamW moments as sharded tensors,
        so it loads at another split; the schedule, step count and RNG in its common part. Every rank calls it (a
        collective); each writes its own shards."""
        from megatron.core import dist_checkpointing  # megatron-core only after layout.cpu_patches (layout.py)
        Path(folder).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self._sharded(), str(folder), preprocess_common_before_consistancy_check=_without_rng)

    def load_sharded(self, folder: str | Path) -> None:
        """`save_sharded`'s checkpoint into this engine, whatever split it was saved at (every rank calls it)."""
        from megatron.core import dist_checkpointing  # megatron-core only after layout.cpu_patches (layout.py)
        got = dist_checkpointing.load(self._sharded(), str(folder))
        model = got["model"]
        if self.draft is not None:
            self.draft.module.load_state_dict({k.removeprefix(DRAFT): model.pop(k) for k in list(model)
                                               if k.startswith(DRAFT)})
        if self.draft_copy is not None:
            self.draft_copy.data.copy_(model.pop(DRAFT_EMBEDDING))
        self.gpt.load_state_dict(model)
        opt = got["optimizer"]
        for st in opt["state"].values():
            st["step"] = torch.tensor(float(got["common"]["opt_step"]))
        self.opt.load_state_dict(opt)
        if self.sched is not None:
            self.sched.load_state_dict(got["common"]["sched"])
        torch.set_rng_state(got["common"]["rng"])
        random.setstate(got["common"]["python_rng"])

    def _sharded(self) -> dict:
        """The policy's sharded state dict (optimizer moments sharded as their parameters), its template on load."""
        # megatron-core only after layout.cpu_patches (layout.py)
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                 optim_state_to_sharding_state)
        if self.role != "policy" or self.opt is None:
            raise ValueError(f"megatron: a distributed checkpoint holds a trained policy (this engine: {self.role})")
        adam = self.opt
        params = [p for g in adam.param_groups for p in g["params"]]
        for p in params:  # a template needs every moment, also before the first step
            if not adam.state[p]:
                adam.state[p] = {"step": torch.zeros((), device=p.device), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        model = self.gpt.sharded_state_dict()
        if self.draft is not None:
            model |= self.draft.sharded_state_dict(DRAFT)
        if self.draft_copy is not None:  # stage one's embedding, as Megatron saves a tied output layer
            model[DRAFT_EMBEDDING] = mtp.sharded_copy(self.draft_copy)
        opt = adam.state_dict()
        step = float(next(iter(opt["state"].values()))["step"]) if opt["state"] else 0.0
        optim_state_to_sharding_state(opt, get_param_id_to_sharded_param_map(model, params), exclude_keys=("step",))
        if self.optimizer.shards:  # each moment on its owner only
            opt["state"] = {i: {k: owned_moment(v) for k, v in st.items()} for i, st in opt["state"].items()}
        return {"model": model, "optimizer": opt,
                "common": {"opt_step": step, "sched": self.sched.state_dict() if self.sched else None,
                           "rng": torch.get_rng_state(), "python_rng": random.getstate()}}
