"""A Linear whose matmul runs in integers: `IntLinear`, the layer a W4A8 compressed-tensors checkpoint's quantized
Linears become (posttrain.quant.int_linear loads them; posttrain.quant.int_experts groups a MoE layer's).

Activations are quantized per token to int8 on the fly, multiplied with the int8 (or int4, held unpacked as int8)
weights in integer arithmetic, and rescaled per group. On CUDA, 4-bit weights go through the packed W4A8 Triton kernel
(`kernels.w4a8`) instead, other shapes through `torch._int_mm` (int8 x int8 -> int32). On CPU the integer products
run as a float GEMM on integer-valued operands: every partial sum of a group's products is an integer of magnitude at
most group x 2^14, exactly representable in float32 up to groups of 1,024 (float64 beyond), so the result is the
integer one to the bit, in any summation order; torch's CPU `_int_mm` took 20-40x longer than that GEMM on the
tiny profile's shapes (2.4 ms against 0.12 ms for 32 x 128 x 384, one thread, AMD EPYC). The integer-valued float
weights are made once a layer (4 bytes a weight, the unquantized model's own size; 8 where a group spans more than
1,024 inputs), not at every call: converting them
was most of a decode step (SmolLM2's 576 x 1536 at one token, groups of 64: 1.08 ms -> 0.24 ms, one thread)."""
from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from kernels import use_triton
from kernels.w4a8 import default_config, kernel_layout, w4a8_linear


EXACT_FLOAT32_K = 2 ** 24 // 2 ** 14  # int8 x int8 products summed over this many stay exact in float32
# rows a CPU call's batched GEMM takes at once: its [groups, rows, out] products stay in cache; a prefill's 1,600 rows
# at once took 4x longer (78 ms against 22 for SmolLM2's 576 x 1536, two threads, AMD EPYC). Each row's result does
# not depend on the rows beside it, so the chunks change no bit.
CPU_ROWS = 64


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [m, k] x int8 [k, n] -> int32 on CUDA (its `_int_mm` wants more than 16 rows, so a decode step's few rows
    are padded)."""
    if a.size(0) <= 16:
        return torch._int_mm(torch.nn.functional.pad(a, (0, 0, 0, 17 - a.size(0))), b)[:a.size(0)]
    return torch._int_mm(a, b)


class IntLinear(torch.nn.Module):
    """y = sum over groups g of (x_q[:, g] @ W_q[g]^T) * s_w[g] * s_x; x_q per-token int8."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, act_bits: int = 8, weight_bits: int = 8):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        self.act_max = 2 ** (act_bits - 1) - 1
        self.register_buffer("qweight_t", q.to(torch.int8).t().contiguous())   # [in, out]
        self.register_buffer("scales_t", scales.float().t().contiguous())      # [groups, out]
        self.kernel_fits = weight_bits == 4 and act_bits == 8 and self.group_size % 16 == 0
        # the Triton kernel's weights by layout, made where each is first used (a decode step's few rows and a
        # prefill's many take different layouts), 4 bits a weight each beside the int8 copy the CPU path reads
        self._packed: dict[str, torch.Tensor] = {}
        self._scales: torch.Tensor | None = None
        self._float_groups: torch.Tensor | None = None  # the CPU path's weights, [groups, group, out], made once

    def _groups(self) -> torch.Tensor:
        """The weights as integer-valued floats, a group's rows each: float32 where a group's sums stay exact in it,
        float64 past EXACT_FLOAT32_K (per-channel int8 over wide inputs)."""
        w = self._float_groups
        if w is None or w.device != self.qweight_t.device:
            dtype = torch.float32 if self.group_size <= EXACT_FLOAT32_K else torch.float64
            w = self._float_groups = self.qweight_t.to(dtype).reshape(-1, self.group_size, self.out_features)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel_fits and use_triton(x2):
            cfg = default_config(x2.size(0), self.in_features, self.group_size)
            packed = self._packed.get(cfg["layout"])
            if packed is None or packed.device != x2.device:  # each layout the kernel uses, made once
                nk = pack_to_int32(self.qweight_t.t().to(x2.device), 4)
                packed = self._packed[cfg["layout"]] = kernel_layout(nk, cfg["layout"])
                self._scales = self.scales_t.t().contiguous().to(x2.device)
            y = w4a8_linear(x2, packed, self._scales, config=cfg)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        x2 = x2.float()
        sx = (x2.abs().amax(-1, keepdim=True) / self.act_max).clamp(min=1e-8)
        xq = torch.round(x2 / sx).clamp(-self.act_max - 1, self.act_max)
        if x2.is_cuda:
            xq, g = xq.to(torch.int8), self.group_size
            acc = torch.zeros(x2.size(0), self.out_features, device=x2.device)
            for k, a in enumerate(range(0, self.in_features, g)):
                acc.addcmul_(_int_mm(xq[:, a:a + g].contiguous(), self.qweight_t[a:a + g]).float(), self.scales_t[k])
        else:  # every group's integer products in one batched GEMM, then scaled and summed over the groups
            w = self._groups()
            xq = xq.to(w.dtype).reshape(x2.size(0), w.size(0), self.group_size).transpose(0, 1)
            acc = x2.new_empty(x2.size(0), self.out_features)
            for a in range(0, x2.size(0), CPU_ROWS):
                acc[a:a + CPU_ROWS] = ((xq[:, a:a + CPU_ROWS] @ w).float() * self.scales_t[:, None, :]).sum(0)
        return (acc * sx).to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"
