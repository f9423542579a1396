"""The PPO critic: the policy checkpoint's transformer with a scalar value head, one value per position."""
from __future__ import annotations

import torch
from transformers import AutoModel

from posttrain.models.attention import padding_free
from posttrain.models.prefix import prefix_forward
from posttrain.models.preset import load_pretrained


class ValueModel(torch.nn.Module):
    def __init__(self, checkpoint: str):
        super().__init__()
        self.backbone = load_pretrained(AutoModel, checkpoint)
        padding_free(self.backbone)  # completions valued as one row without padding where cheaper (models.prefix)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # starts predicting 0 everywhere: no made-up baseline
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, samples: list, pad_id: int) -> torch.Tensor:
        """V(state before completion token j) for every j, in posttrain.models.prefix's completion layout."""
        return self.head(prefix_forward(self.backbone, samples, pad_id, "last_hidden_state")).squeeze(-1).float()
