"""The attention implementation is chosen by config (`ramp.attention`): the seam sparse attention plugs into.

transformers dispatches attention (and the mask built for it) through two registries; `register` adds a
name to both; posttrain.models.dsa registers "dsa" this way (its indexers installed by
`posttrain.models.dsa.install`), and posttrain.models.packed_attention "packed_sdpa" (the ramp's default: sdpa
that skips the scores between packed documents) and "varlen_sdpa" (the same at every length, for padding-free
batches). "sdpa" and "eager" are the dense references.
"""
from __future__ import annotations

from collections.abc import Callable

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from posttrain.models import dsa as _dsa  # noqa: F401  (registers "dsa")
from posttrain.models import mtp, packed_attention
from posttrain.models.glm5 import is_glm5


def register(name: str, attention: Callable, mask: Callable = sdpa_mask) -> None:
    """Make `name` selectable: `attention` has transformers' attention-function signature; `mask` builds
    the mask it receives (default: a boolean [B, 1, q, kv] mask, document boundaries included)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


register("packed_sdpa", packed_attention.packed_sdpa, packed_attention.packed_mask)
register("varlen_sdpa", packed_attention.varlen_sdpa, packed_attention.varlen_mask)

# implementations that read packed documents from restarting positions at the cost of their own lengths
VARLEN = ("varlen_sdpa", "flash_attention_2", "flash_attention_3")


def padding_free(model) -> bool:
    """Whether `model` takes a batch as one row of documents, positions restarting at each, no padding
    (posttrain.train.flat_examples): then no layer computes anything for padding. A model on sdpa or
    packed_sdpa is switched to varlen_sdpa for it (its MTP layer too). Eager, a sliding-window model (its
    window lives in a mask, which would be the whole row's length squared), dsa and other implementations keep
    padded batches."""
    m = getattr(model, "module", model)
    if getattr(m.config, "sliding_window", None) or is_glm5(m):  # GLM-5's DSA indexer reads a full 4D mask
        return False
    if m.config._attn_implementation in ("sdpa", "packed_sdpa"):
        _switch(m, "varlen_sdpa")
    return reads_documents(m)


def fast_decoding(model) -> None:
    """A model on sdpa is switched to packed_sdpa, the same attention with `decode_attention` for decoding steps
    (posttrain.models.packed_attention); its MTP layer follows. Others keep theirs (varlen_sdpa has it already)."""
    m = getattr(model, "module", model)
    if m.config._attn_implementation == "sdpa" and not is_glm5(m):
        _switch(m, "packed_sdpa")


def _switch(model, name: str) -> None:
    """`model` to attention `name`, its MTP layer following."""
    use(model, name)
    if (draft := mtp.get(model)) is not None:
        draft.follow_attention(model)


def reads_documents(model) -> bool:
    """Whether `model`'s attention reads packed documents from restarting positions (see padding_free)."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) in VARLEN


def known() -> list[str]:
    return sorted({"eager", *AttentionInterface._global_mapping} - {"paged|eager"})


def use(model, name: str):
    """Switch `model` to attention `name`; an unknown name fails naming the known ones."""
    if name not in known():
        raise ValueError(f"unknown attention implementation {name!r}; known: {', '.join(known())} "
                         f"(add one with posttrain.models.attention.register)")
    if is_glm5(model) and name not in ("sdpa", "eager"):
        raise ValueError(f"attention {name!r}: GLM-5's DSA indexer selects keys through a full 4D mask, which only "
                         f"transformers' sdpa and eager build; use one of those")
    if name == "dsa" and not hasattr(model.model.layers[0].self_attn, "dsa_state"):
        raise ValueError("attention 'dsa' needs lightning indexers: posttrain.models.dsa.install(model, top_k=...) "
                         "(the ramp does it for ramp.attention: dsa)")
    model.set_attn_implementation(name)
    return model
