"""The RL loop's trained models on this process's rank, each behind a train engine (posttrain.engines), and one
optimizer step over them: what the loop (posttrain.rl.loop) drives directly, and each rank actor over several ranks
(posttrain.rl.ranks)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.config import MoEConfig, RLConfig
from posttrain.engines import TrainEngine, train_engine
from posttrain.rl.opd_loss import distill_backward
from posttrain.rl.step import train_step
from posttrain.rl.workers import Sample


@dataclass
class Engines:
    """The trained models of the loop."""
    policy: TrainEngine
    critic: TrainEngine | None = None   # ppo: a value head on the policy's backbone
    ref: TrainEngine | None = None      # the sft checkpoint, frozen: kl_coef > 0, or the KL alarm

    def save(self, path: Path, st) -> None:
        """The engines' state and the loop's (`st`: its State) in one file."""
        tmp = path.with_suffix(".tmp")
        torch.save({"policy": self.policy.state_dict(), "critic": self.critic.state_dict() if self.critic else None,
                    "state": st}, tmp)
        os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact

    def load(self, path: Path):
        """The engines' state from `save`'s file; returns the loop's State saved with it."""
        ck = torch.load(path, weights_only=False)  # our own scratch file, written by save
        if "ranks" in ck:
            raise ValueError(f"{path}: a checkpoint of {len(ck['ranks'])} trainer ranks, not one")
        if self.critic is not None:
            self.critic.load_state_dict(ck["critic"])
        self.policy.load_state_dict(ck["policy"])  # last: its RNG state is the one that continues
        return ck["state"]

    def update(self, r: RLConfig, batch: list[Sample], dbatch: list[Sample], distill) -> dict:
        return update(r, self, batch, dbatch, distill)

    def close(self) -> None:
        """Release what the engines hold beyond this process's garbage collection (RankedEngines: its rank actors)."""
        for e in (self.policy, self.critic, self.ref):
            if e is not None:
                e.close()


def local_engines(r: RLConfig, sft: str, with_critic: bool, rl: bool = True, moe: MoEConfig | None = None,
                  engine: tuple[str, dict] = ("torch", {})) -> Engines:
    """The loop's trained models on this process's rank (posttrain.rl.loop.build_engines' arguments)."""
    watch_kl = rl and r.alarms.enabled and r.alarms.reference_kl
    name, opts = engine
    opts = dict(opts)
    lora = {"lora": opts.pop("lora")} if "lora" in opts else {}  # the policy's adapters (lora_options); critic: full
    return Engines(train_engine(name, sft, lr=r.lr, moe=moe, routing_replay=r.routing_replay, **opts, **lora),
                   train_engine(name, sft, "critic", lr=r.critic_lr, **opts) if with_critic else None,
                   train_engine(name, sft, "reference", **opts) if r.kl_coef > 0 or watch_kl else None)


def update(r: RLConfig, eng: Engines, batch: list[Sample], dbatch: list[Sample], distill) -> dict[str, float]:
    """One optimizer step: the RL loss on `batch`, plus the distillation loss on `dbatch` (`distill`: the loop's
    Distill, whose mode, coef and reward_weight it reads; None without distillation)."""
    extra = (lambda: distill_backward(
        eng.policy, dbatch, mode=distill.mode, coef=distill.coef, reward_weight=distill.reward_weight,
        temperature=r.temperature, clip_eps=r.clip_eps, is_lower=r.is_lower, is_upper=r.is_upper,
        max_cells=r.micro_batch_cells, ref=eng.ref, kl_coef=distill.kl_coef)) if dbatch else None
    eng.policy.train()
    stats = train_step(r, eng.policy, batch, eng.critic, eng.ref, extra)
    eng.policy.eval()
    return stats
