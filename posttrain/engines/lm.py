"""The LM loss of base, the ramp and sft as the torch engine computes it: masked next-token cross-entropy, plus, as
gradients only (the reported loss stays comparable with a run without them), the routers' balance loss, the DSA
indexers' KL (the ramp) and the draft (MTP) layer's loss. The megatron engine computes the same inside its forward."""
from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.models import dsa, mtp
from posttrain.models.head import sequence_nll
from posttrain.models.moe import RouterHooks, with_aux_loss

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]


def masked_lm_loss(model, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy, the mean weighted by `loss_mask` of the target token (0: no loss; those
    positions never reach the output head on the fused path, posttrain.models.head).

    No KV cache: with one, transformers would not read packed documents out of `position_ids`."""
    dev = next(model.parameters()).device
    batch = {k: v.to(dev) for k, v in batch.items() if v is not None}
    mask = batch["loss_mask"][:, 1:]
    weights = mask[mask != 0].float() / mask.float().sum().clamp(min=1)  # the mean's divisor known beforehand
    return sequence_nll(model, batch["input_ids"], batch["loss_mask"], weights,
                        attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids"),
                        use_cache=False)


def _with_indexer_loss(loss_fn: LossFn, weight: float, curves: dict[str, list[float]]) -> LossFn:
    """`loss_fn` plus the DSA indexers' KL as a gradient only."""
    def fn(model, batch):
        loss = loss_fn(model, batch)
        aux, kl, recall = dsa.state(model).pop()
        if aux is None:
            return loss
        curves.setdefault("indexer_kl", []).append(kl)
        curves.setdefault("topk_recall", []).append(recall)
        return loss + weight * (aux - aux.detach())
    return fn


def _indexer_only(curves: dict[str, list[float]]) -> LossFn:
    """DSA's warm-up: the indexers' KL toward the dense attention, the only loss (everything else is frozen)."""
    def fn(m, batch):
        batch = {k: v.to(next(m.parameters()).device) for k, v in batch.items() if v is not None}
        m.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), use_cache=False)  # the indexers hook into the layers
        aux, kl, recall = dsa.state(m).pop()
        curves.setdefault("indexer_kl", []).append(kl)
        curves.setdefault("topk_recall", []).append(recall)
        return aux
    return fn


class LMLoss:
    """The torch engine's LM loss for one training job, and what it changes on the model while it trains (undone by
    `close`). `indexers`: ("warmup", ...) trains DSA's indexers alone toward the dense attention; otherwise a model
    with DSA adds its indexers' KL at `dsa_weight`. `figures()`: the per-forward figures (indexer KL and recall, MTP
    loss and accuracy, balance loss) averaged since the last call, one value per optimizer step."""

    def __init__(self, model: torch.nn.Module, *, mtp_weight: float = 0.0, dsa_weight: float = 0.0,
                 indexers: tuple | None = None, routers: RouterHooks | None = None, aux_weight: float = 0.0,
                 recompute: bool = False):
        self.model, self.curves, self._undo = model, {}, []
        if recompute:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            self._undo.append(model.activation_checkpointing_disable)
        st = dsa.state(model)
        if indexers is not None and indexers[0] == "warmup":
            trainable = [p for p in model.parameters() if p.requires_grad]
            for p in trainable:
                p.requires_grad_(False)
            for p in dsa.indexer_parameters(model):
                p.requires_grad_(True)
            collecting, st.mode, st.collect = st.collect, "warmup", True
            self._undo.append(lambda: [p.requires_grad_(True) for p in trainable])
            self._undo.append(lambda: setattr(st, "mode", "sparse") or setattr(st, "collect", collecting))
            self.fn = _indexer_only(self.curves)
            return
        fn: LossFn = masked_lm_loss
        if st is not None:
            collecting, st.collect = st.collect, True
            self._undo.append(lambda: setattr(st, "collect", collecting))
            fn = _with_indexer_loss(fn, dsa_weight, self.curves)
        fn = mtp.with_loss(fn, mtp_weight, self.curves)
        if routers is not None and aux_weight:  # outermost: the draft layer's router counts too
            fn = with_aux_loss(fn, routers, aux_weight, self.curves.setdefault("moe_aux_loss", []))
        self.fn = fn

    def __call__(self, model, batch: Batch) -> torch.Tensor:
        return self.fn(model, batch)

    def figures(self) -> dict[str, float]:
        out = {k: sum(xs) / len(xs) for k, xs in self.curves.items() if xs}
        for xs in self.curves.values():
            xs.clear()
        return out

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()
