"""LoRA adapters on a model the torch train engine trains (`lora.rank` > 0, in the stages `lora.stages` names):
peft's LoRA layers injected in place, so the model keeps its class and every forward posttrain runs on it; the
base weights frozen; what leaves the engine (weights for the rollout workers, the exported checkpoint) is merged,
W + B A, under the model's own names, so nothing downstream knows adapters were used."""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch

ADAPTER = "default"


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    targets: tuple[str, ...] | str = "all-linear"  # peft's: every linear layer but the output head
    dropout: float = 0.0


def attach(model: torch.nn.Module, lora: Lora) -> torch.nn.Module:
    """`model` with LoRA layers on its `targets`, only they trainable (the base weights frozen)."""
    from peft import LoraConfig, inject_adapter_in_model  # peft: ~1-3 s to import, only where adapters train
    targets = lora.targets if isinstance(lora.targets, str) else list(lora.targets)
    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                     exclude_modules=["lm_head"] if targets == "all-linear" else None)
    inject_adapter_in_model(cfg, model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"lora.targets {lora.targets!r}: no layer of {type(model).__name__} matched")
    return model


def _layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    if "peft.tuners.lora" not in sys.modules:  # never imported: nothing attached any adapter
        return []
    from peft.tuners.lora import LoraLayer
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def attached(model: torch.nn.Module) -> bool:
    return bool(_layers(model))


def _own_name(key: str) -> str:
    """A state-dict key as the model without adapters names it (peft nests each wrapped layer as `base_layer`)."""
    return key.replace(".base_layer", "")


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as a model without adapters would have it: each adapted weight is W + B A (scaled).
    A layer's adapter wraps its `weight`; on fused MoE experts (GLM-5) peft wraps the experts' parameters
    themselves (`parameter_name`: gate_up_proj, down_proj), one wrapper inside the other."""
    deltas = {f"{_own_name(n)}.{getattr(m, 'parameter_name', None) or 'weight'}": m.get_delta_weight(ADAPTER)
              for n, m in _layers(model)}
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        name = _own_name(k)
        out[name] = (v + deltas[name].to(v.dtype)) if name in deltas else v
    return out


@torch.no_grad()
def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every LoRA layer folded into its base layer and removed (what is exported)."""
    out = copy.deepcopy(model)
    for name, m in _layers(out):
        m.merge(adapter_names=[ADAPTER])
        parent, _, leaf = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, leaf, m.get_base_layer())
    for p in out.parameters():
        p.requires_grad_(True)
    return out
