"""The PPO critic: the policy checkpoint's transformer with a scalar value head, one value per position."""
from __future__ import annotations

import torch
from transformers import AutoModel


class ValueModel(torch.nn.Module):
    def __init__(self, checkpoint: str):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(checkpoint, dtype=torch.float32)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # starts predicting 0 everywhere: no made-up baseline
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """V(state before target j) for every target position j, aligned with `token_logits`."""
        h = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return self.head(h[:, :-1]).squeeze(-1)
