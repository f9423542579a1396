"""Weights posttrain adds to a Hugging Face model (DSA indexers, the MTP layer), which `from_pretrained` drops as
unexpected: loaded from the checkpoint's safetensors by the modules that add them (posttrain.models.dsa, .mtp)."""
from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def load_added_weights(model, checkpoint: str | Path, keep, what: str) -> None:
    """Load the tensors `keep(name)` selects from `checkpoint`'s safetensors; all of them or a loud error."""
    prefix = "" if hasattr(model, "model") else "model."  # a bare backbone's keys lack the `model.` prefix
    weights = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            weights.update({k.removeprefix(prefix): st.get_tensor(k) for k in st.keys() if keep(k)})
    expected = {k for k in model.state_dict() if keep(k)}
    if set(weights) != expected:
        raise ValueError(f"{checkpoint}: config.json names {what}, but the weights hold "
                         f"{len(set(weights) & expected)} of its {len(expected)} tensors")
    model.load_state_dict(weights, strict=False)
