"""What bench/quant_sensitivity and bench/quant_smooth share: the export's int8 activations as a forward hook, and
a variant compared with the unquantized model teacher-forced on that model's own answers."""
from __future__ import annotations

import torch

Rows = dict[str, list[tuple[list[int], list[int]]]]  # prompt set -> (prompt ids, the unquantized model's answer ids)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to int8 per row (absmax scale) and back."""
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
    return torch.round(x / s).clamp(-128, 127) * s


def act_int8(_module, inputs):
    """A Linear's input quantized per token to int8 and back, as the integer kernels see it."""
    return (int8_rows(inputs[0]),)


@torch.no_grad()
def answer_logps(model, rows: Rows) -> dict[str, list[torch.Tensor]]:
    """Per prompt set, each answer's next-token log-probabilities (answer positions only)."""
    return {k: [torch.log_softmax(model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1:-1].float(), -1)
                for p, a in rs if a] for k, rs in rows.items()}


def agreement(ref: dict[str, list[torch.Tensor]], got: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Per prompt set: mean KL(ref || got) per answer token, and the share of positions with the same top token."""
    out = {}
    for k in ref:
        kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref[k], got[k])])
        same = torch.cat([(r.argmax(-1) == g.argmax(-1)).float() for r, g in zip(ref[k], got[k])])
        out[k] = {"kl": round(kl.mean().item(), 5), "top1_agree": round(same.mean().item(), 4)}
    return out
