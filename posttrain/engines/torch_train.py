"""The local train engine: a torch module and its AdamW optimizer in this process (CPU or one GPU; a DDP
module under Ray Train)."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from posttrain.chat import pad_id
from posttrain.config import MoEConfig
from posttrain.device import autocast
from posttrain.device import device as default_device
from posttrain.engines import lora as lora_
from posttrain.engines import optim
from posttrain.engines.base import Forward, one_by_one
from posttrain.engines.lm import LMLoss, masked_lm_loss
from posttrain.models.attention import padding_free
from posttrain.models.head import completion_loss, completion_reverse_kl_loss, completion_scores
from posttrain.models.moe import RouterHooks
from posttrain.models.prefix import prefix_forward
from posttrain.models.preset import load_checkpoint
from posttrain.models.value import ValueModel
from posttrain.routing_replay import prefix_calls


def policy_logits(pad_id: int) -> Forward:
    """A causal LM's logits in the completion layout (each distinct prompt run once)."""
    return lambda model, samples: prefix_forward(model, samples, pad_id)


class TorchTrainEngine:
    """`model` trained with AdamW at `lr` (or a given `optimizer`; neither: forward only, e.g. the KL
    reference), its learning rate times `schedule(step)` when given; `forward` maps (model, batch) to what
    the caller's loss needs: logits or values in the completion layout (RL), the loss itself (LM training)."""

    def __init__(self, model: torch.nn.Module, forward: Forward, *, lr: float | None = None,
                 weight_decay: float = 0.0, optimizer: torch.optim.Optimizer | None = None,
                 schedule: Callable[[int], float] | None = None, device: str | torch.device | None = None,
                 tokenizer=None, pad_id: int = 0, moe: MoEConfig | None = None, routing_replay: bool = False,
                 lora: "lora_.Lora | None" = None):
        self.device = torch.device(device) if device is not None else default_device()
        self.model, self.tokenizer = model.to(self.device), tokenizer
        self._forward, self.pad_id = forward, pad_id
        # LoRA adapters (posttrain.engines.lora): only they train; weights and exports leave merged
        if lora is not None and not lora_.attached(self._module):  # for_lm attaches before DDP wraps the model
            lora_.attach(self._module, lora)
        self.lora = lora is not None
        trained = [p for p in model.parameters() if p.requires_grad] if self.lora else model
        self.opt = optimizer or (optim.make_optimizer(trained, lr, weight_decay) if lr is not None else None)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule) if schedule else None
        # `moe` given, a model with routers trained: expert load per step and its balancing (posttrain/models/moe.py);
        # `routing_replay`: the policy's forwards run through the experts the samples' rollouts chose
        self.moe = moe or MoEConfig()
        trained = moe is not None and self.opt is not None
        hooks = RouterHooks(self._module, aux=trained and self.moe.aux_loss_weight > 0) \
            if trained or routing_replay else None
        self.routers = hooks if hooks is not None and hooks.routers else None
        if routing_replay and self.routers is None:
            raise ValueError(f"rl.routing_replay: {type(self._module).__name__} has no mixture-of-experts router")
        self.routing_replay, self._balance = routing_replay, trained and self.routers is not None
        self.moe_stats: dict[str, float] = {}
        self._lm: LMLoss | None = None

    @classmethod
    def for_lm(cls, model: torch.nn.Module | None, tok=None, checkpoint: str | Path | None = None, *, lr: float,
               weight_decay: float = 0.0, moe: MoEConfig | None = None, mtp_weight: float = 0.0,
               dsa_weight: float = 0.0, indexers: tuple | None = None, recompute: bool = False,
               prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None, lora=None,
               **_) -> "TorchTrainEngine":
        """`model` itself (`checkpoint`'s only where no model is given) trained on the LM loss (posttrain.engines.lm);
        `prepare` readies it for the ranks (Ray Train's DDP and device). `close` undoes what the job changed on it."""
        if model is None:
            model, tok = load_checkpoint(checkpoint)
        if lora is not None:  # before Ray Train's DDP wraps it: the adapters are what its ranks all-reduce
            lora_.attach(model, lora)
        engine = cls(prepare(model) if prepare else model, masked_lm_loss, lr=lr, weight_decay=weight_decay,
                     tokenizer=tok, moe=moe, lora=lora)
        engine._lm = engine._forward = LMLoss(
            model, mtp_weight=mtp_weight, dsa_weight=dsa_weight, indexers=indexers, recompute=recompute,
            routers=engine.routers, aux_weight=engine.moe.aux_loss_weight if engine.routers is not None else 0.0)
        return engine

    @classmethod
    def from_checkpoint(cls, path: str | Path, role: str = "policy", *, lr: float | None = None,
                        moe: MoEConfig | None = None, routing_replay: bool = False,
                        lora=None) -> "TorchTrainEngine":
        from transformers import AutoTokenizer  # transformers: at first use (the CLI's checks import this module)

        if role == "critic":
            tok = AutoTokenizer.from_pretrained(path)
            pad = pad_id(tok)
            return cls(ValueModel(path), lambda m, samples: m(samples, pad), lr=lr, tokenizer=tok)
        model, tok = load_checkpoint(path)
        padding_free(model)  # completions scored as one row without padding where that is cheaper (models.prefix)
        pad = pad_id(tok)
        if role == "reference":
            return cls(model.eval(), policy_logits(pad), tokenizer=tok, pad_id=pad)
        try:
            return cls(model, policy_logits(pad), lr=lr, tokenizer=tok, pad_id=pad, moe=moe,
                       routing_replay=routing_replay, lora=lora)
        except ValueError as e:
            raise ValueError(f"{e} (checkpoint {path})") from None

    @property
    def _module(self) -> torch.nn.Module:  # the model itself under a DDP wrapper
        return getattr(self.model, "module", self.model)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def forward(self, samples) -> torch.Tensor:
        with autocast(self.device):
            return self._forward(self.model, samples)

    @contextmanager
    def _replaying(self, samples):
        """Routing replay around one prefix forward (posttrain.routing_replay), when on."""
        if not self.routing_replay:
            yield
            return
        self.routers.replay_calls(prefix_calls(samples, self.routers.routed))
        try:
            yield
        finally:
            self.routers.replay_calls(None)

    def logprobs(self, samples, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.device), self._replaying(samples):
            return completion_scores(self.model, samples, self.pad_id, temperature)

    @torch.no_grad()
    def unreplayed_logprobs(self, samples, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` with every router choosing its own experts: what routing replay removes, measured
        (posttrain.rl.step's probe). No load is counted (no grad)."""
        with autocast(self.device):
            return completion_scores(self.model, samples, self.pad_id, temperature)

    def logprob_loss(self, samples, temperature: float, loss_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with autocast(self.device), self._replaying(samples):
            return completion_loss(self.model, samples, self.pad_id, temperature, loss_of)

    def reverse_kl_loss(self, samples, teacher: list[torch.Tensor], temperature: float,
                        token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.device), self._replaying(samples):
            return completion_reverse_kl_loss(self.model, samples, self.pad_id, teacher, temperature, token_weights)

    def step_stats(self) -> dict[str, float]:
        """The last step's expert load, the routes replayed since the last call (and the share the router would have
        chosen otherwise), and the LM job's per-forward figures averaged over the step."""
        replayed = self.routers.take_replayed() if self.routing_replay else {}
        return self.moe_stats | replayed | (self._lm.figures() if self._lm else {})

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def logprob_losses(self, parts: list[tuple[list, Callable]], temperature: float
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return one_by_one(self, parts, temperature)

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        loss = self.forward(batch) * scale
        loss.backward()
        return loss.detach()

    def step(self, max_grad_norm: float = 1.0) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm).item()
        self.opt.step()
        if self.sched:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self._balance:
            self.moe_stats = self.routers.after_step(self.moe.bias_update_rate)
        return norm

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def weights(self) -> dict[str, torch.Tensor]:
        """On CPU (no copy there): rollout workers and teachers reserve no GPU, and a CUDA tensor does not
        unpickle in a process that has none."""
        if self.lora:
            return {k: v.detach().cpu() for k, v in lora_.merged_weights(self._module).items()}
        return {k: v.detach().cpu() for k, v in self._module.state_dict().items()}

    def state_dict(self) -> dict:
        return optim.training_state(self._module, self.opt, self.sched)

    def load_state_dict(self, state: dict) -> None:
        optim.load_training_state(self._module, self.opt, self.sched, state)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def with_schedule(self, schedule: Callable[[int], float], lr: float) -> "TorchTrainEngine":
        for group in self.opt.param_groups:
            group["lr"] = group["initial_lr"] = lr
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        return self

    @torch.no_grad()
    def lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return masked_lm_loss(self.model, batch)

    def data_shard(self) -> tuple[int, int]:
        dist = torch.distributed
        return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)

    def hf_model(self) -> torch.nn.Module:
        """The model as a checkpoint holds it: with LoRA, a merged copy (the adapters keep training)."""
        return lora_.merged_copy(self._module) if self.lora else self._module

    def close(self) -> None:
        """Undo what the LM job changed on the model (frozen weights, DSA's modes, activation checkpointing)."""
        if self._lm is not None:
            self._lm.close()
