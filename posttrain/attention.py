"""The attention implementation is chosen by config (`ramp.attention`): the seam sparse attention plugs into.

transformers dispatches attention (and the mask built for it) through two registries; `register` adds a
name to both, so a DSA indexer + sparse kernel (the kernels work) becomes `ramp.attention: dsa` without
touching the trainer. "sdpa" (default) and "eager" are the dense references on CPU.
"""
from __future__ import annotations

from collections.abc import Callable

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def register(name: str, attention: Callable, mask: Callable = sdpa_mask) -> None:
    """Make `name` selectable: `attention` has transformers' attention-function signature; `mask` builds
    the mask it receives (default: a boolean [B, 1, q, kv] mask, document boundaries included)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


def known() -> list[str]:
    return sorted({"eager", *AttentionInterface._global_mapping} - {"paged|eager"})


def use(model, name: str):
    """Switch `model` to attention `name`; an unknown name fails naming the known ones."""
    if name not in known():
        raise ValueError(f"unknown attention implementation {name!r}; known: {', '.join(known())} "
                         f"(add one with posttrain.attention.register)")
    model.set_attn_implementation(name)
    return model
