"""Training batches for RL in the completion layout: column j of a sample's row is its completion token ids[j],
what posttrain.models.prefix.prefix_forward's output at column j predicts."""
from __future__ import annotations

import torch

from posttrain.models.prefix import pad_rows


def completion_batch(samples: list, device=None) -> dict[str, torch.Tensor]:
    """Right-padded completions: column j is token ids[j] (generated or tool output), its mask and logprob."""
    return {"ids": pad_rows([s.ids for s in samples], 0, device=device),
            "mask": pad_rows([s.gen_mask for s in samples], 0, torch.float, device),
            "old_logprobs": pad_rows([s.logprobs for s in samples], 0.0, torch.float, device)}


