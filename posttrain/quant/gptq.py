"""GPTQ (Frantar et al. 2022): quantize a weight matrix column by column, pushing each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's calibration
inputs (H = 2 X^T X). Plain round-to-nearest is `rtn`.

Written here because llm-compressor (the maintained GPTQ) pins transformers 5.17 and compressed-tensors
0.19, older than ours; the export stays on compressed-tensors (posttrain/stages/quantize.py)."""
from __future__ import annotations

import torch


def symmetric_scale(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-row scale mapping the row's largest magnitude to the top integer (float32, [rows, 1])."""
    return (w.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)).clamp(min=1e-8)


def round_to(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    return torch.round(w / scale).clamp(-qmax - 1, qmax)


def rtn(w: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest per group of `group_size` input columns: (int8 q [out, in], float32 scales [out, in/g])."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group_size, group_size)
    scale = symmetric_scale(wg, bits).to(scale_dtype).float()
    return round_to(wg, scale, bits).reshape(out_f, in_f).to(torch.int8), scale.squeeze(-1)


def mse_scale(w: torch.Tensor, bits: int, steps: int = 16, lowest: float = 0.6) -> torch.Tensor:
    """Per-row scale minimising the squared rounding error, over clipping ratios from 1 down to `lowest`."""
    base = symmetric_scale(w, bits)
    best, best_err = base, torch.full_like(base, float("inf"))
    for r in torch.linspace(1.0, lowest, steps):
        s = base * r
        err = ((round_to(w, s, bits) * s - w) ** 2).sum(-1, keepdim=True)
        best, best_err = torch.where(err < best_err, s, best), torch.minimum(err, best_err)
    return best


def gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
         dampening: float = 0.01, act_order: bool = True, mse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ with groups. `act_order` quantizes the columns with the largest input energy first (llm-compressor's
    "static" order: group scales are taken from the weights before any update, and groups stay contiguous
    in the original column order, so the format needs no index); otherwise a group's scale is fixed when its
    first column is reached. `mse` searches each group's clipping ratio. Returns (int8 q [out, in], float32
    scales [out, in/g]) like `rtn`; scales are representable in `scale_dtype`."""
    W = w.detach().clone().float()
    out_f, in_f = W.shape
    H = hessian.detach().clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += dampening * torch.diag(H).mean() * torch.eye(in_f, dtype=H.dtype)
    scale_of = mse_scale if mse else symmetric_scale
    scales = torch.zeros(out_f, in_f // group_size)
    perm = torch.arange(in_f)
    if act_order:
        scales = scale_of(W.reshape(out_f, -1, group_size), bits).to(scale_dtype).float().squeeze(-1)
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.zeros_like(W)
    block = 128 if act_order or group_size >= in_f else min(group_size, 128)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1, err1 = W[:, i1:i2].clone(), torch.zeros(out_f, i2 - i1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not act_order and col % group_size == 0:  # the group's scale, from its columns as they stand now
                g = W1[:, i:i + group_size] if group_size <= block else W[:, col:col + group_size]
                scales[:, col // group_size] = scale_of(g, bits).to(scale_dtype).float().squeeze(-1)
            s = scales[:, int(perm[col]) // group_size]
            q = round_to(W1[:, i], s, bits)
            Q[:, col] = q
            err = (W1[:, i] - q * s) / h1[i, i]
            W1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return Q[:, torch.argsort(perm)].to(torch.int8), scales


class HessianTracker:
    """Accumulates 2 X^T X / n of the inputs of the given Linear modules over forward passes."""

    def __init__(self, modules: dict[str, torch.nn.Linear]):
        self.h = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in modules.items()}
        self.n = dict.fromkeys(modules, 0)
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in modules.items()]
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, its X^T X): q, k and v share one

    def _hook(self, name: str):
        def hook(_module, args):
            if self._last is None or self._last[0] is not args[0]:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                self._last = (args[0], x.T @ x)
            rows = args[0].numel() // args[0].shape[-1]
            n = self.n[name] + rows
            self.h[name] *= self.n[name] / max(n, 1)
            self.h[name] += (2.0 / max(n, 1)) * self._last[1]
            self.n[name] = n
        return hook

    def close(self) -> dict[str, torch.Tensor]:
        self._last = None
        for h in self.handles:
            h.remove()
        return self.h
