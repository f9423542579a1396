"""A W4A8 mixture-of-experts layer's routed experts in three grouped launches on a Triton device.

After loading, each routed expert of a GLM-5-shaped model is three `IntLinear`s (posttrain.models.moe.LinearExperts,
one per expert as GPTQ calibrated and compressed-tensors stores them). Looping over the experts costs a launch (or
three) per expert with tokens: at 256 experts that is most of a decode step. Here the token copies are sorted by
expert and each projection runs as one `kernels.w4a8.w4a8_grouped` launch over every expert (tokens sorted by
expert, one block table); on CPU, or where a projection does not fit the kernel, the loop runs as before."""
from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from kernels import use_triton
from kernels.w4a8 import default_config, kernel_layout, w4a8_grouped
from posttrain.models.moe import LinearExperts
from posttrain.quant.int_matmul import IntLinear

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class IntExperts(LinearExperts):
    """LinearExperts whose experts are all W4A8 `IntLinear`s: the same forward contract and result (up to the order
    of float sums), grouped launches where the kernel runs."""

    def __init__(self, experts):
        super().__init__(experts)
        self._weights: dict[tuple[str, str], torch.Tensor] = {}  # (projection, layout) -> [E, ...] packed, made once
        self._scales: dict[str, torch.Tensor] = {}
        layers = [getattr(x, p) for x in self for p in PROJECTIONS]  # fixed once loaded: checked once
        self.grouped_fits = all(isinstance(m, IntLinear) and m.kernel_fits for m in layers) and all(
            len({(getattr(x, p).group_size, getattr(x, p).in_features) for x in self}) == 1 for p in PROJECTIONS)

    def _project(self, name: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        first = getattr(self[0], name)
        cfg = default_config(max(1, x.size(0) // len(self)), first.in_features, first.group_size, grouped=True)
        key = (name, cfg["layout"])
        if key not in self._weights or self._weights[key].device != x.device:
            nk = torch.stack([pack_to_int32(getattr(e, name).qweight_t.t(), 4) for e in self]).to(x.device)
            self._weights[key] = kernel_layout(nk, cfg["layout"])
            self._scales[name] = torch.stack([getattr(e, name).scales_t.t() for e in self]).contiguous().to(x.device)
        return w4a8_grouped(x, offsets, self._weights[key], self._scales[name], config=cfg).to(x.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if not (use_triton(hidden_states) and self.grouped_fits):
            return super().forward(hidden_states, top_k_index, top_k_weights)
        tokens, k = top_k_index.shape
        flat = top_k_index.flatten()
        order = flat.argsort(stable=True)  # token copies sorted by expert
        counts = torch.bincount(flat, minlength=len(self))
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        x = hidden_states[order // k]
        h = self[0].act_fn(self._project("gate_proj", x, offsets)) * self._project("up_proj", x, offsets)
        y = self._project("down_proj", h, offsets) * top_k_weights.flatten()[order, None]
        back = torch.empty_like(y)
        back[order] = y  # (token, slot) order again: the k copies summed in a fixed order (no atomics)
        return back.view(tokens, k, -1).sum(1).to(hidden_states.dtype)


def group_int_experts(model: torch.nn.Module) -> int:
    """Make every LinearExperts of `model` whose experts are all IntLinear an IntExperts; returns how many."""
    n = 0
    for name, m in list(model.named_modules()):
        if type(m) is LinearExperts and all(isinstance(getattr(x, p), IntLinear) for x in m for p in PROJECTIONS):
            model.set_submodule(name, IntExperts(list(m)))
            n += 1
    return n
