"""Whether a causal LM's logits are its last hidden state times its output embeddings: what the fused head kernels
(posttrain.models.head) and the MTP layer, which shares the model's head (posttrain.models.mtp), both rely on."""
from __future__ import annotations

# config keys that scale or cap the logits (Gemma's soft-cap, Cohere's scale, ...)
SCALING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def scaling(config) -> dict:
    """The logit scalings `config` sets (a key at 1 or None scales nothing)."""
    return {k: getattr(config, k) for k in SCALING if getattr(config, k, None) not in (None, 1, 1.0)}
