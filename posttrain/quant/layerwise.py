"""Passing calibration activations through a decoder stack one layer at a time (GPTQ and the smoothing search both
work a layer at a time on what the layers before it output)."""
from __future__ import annotations

import contextlib

import torch


class _Captured(Exception):
    """Stops a forward once the decoder layers' inputs are captured."""


def layer_inputs(model, rows: torch.Tensor, batch: int) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """Per batch of `rows`: the hidden states entering the first decoder layer, and every layer's own keyword
    arguments (its mask and position embeddings, which a layer type may have of its own), from one forward that
    stops at the last layer."""
    layers, hidden, kwargs = model.model.layers, [], []

    def grab(i):
        def hook(_m, args, kw):
            if i == 0:
                hidden.append(args[0] if args else kw["hidden_states"])
                kwargs.append([])
            kwargs[-1].append({k: v for k, v in kw.items() if k != "hidden_states"})
            if i == len(layers) - 1:
                raise _Captured
        return hook
    handles = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        for i in range(0, len(rows), batch):
            with contextlib.suppress(_Captured):  # the last layer's hook ends the forward: nothing after it is needed
                model(rows[i:i + batch], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return hidden, kwargs


def through(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One decoder layer's output hidden states."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out
