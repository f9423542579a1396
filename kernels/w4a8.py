"""W4A8 GEMM: int4 group-quantized weights, packed as compressed-tensors packs them (8 signed nibbles per
int32 along the input dimension, stored +8), times int8 per-token activations; int32 accumulation per group,
rescaled by the group's weight scale and the token's activation scale.

torch has no int4 x int8 matmul (`torch._int_mm` is int8 x int8 and needs the weights unpacked, 2x the
bytes); the kernel reads the packed weights and unpacks them in registers, which is where the speed at small
batch comes from (the GEMM is bound by reading the weights)."""
from __future__ import annotations

import torch

from kernels import jit_cache


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: (xq [M, K] int8, scale [M] fp32), x ~= xq * scale[:, None]."""
    top = 2 ** (bits - 1) - 1
    sx = (x.float().abs().amax(-1) / top).clamp(min=1e-8)
    return torch.round(x.float() / sx[:, None]).clamp(-top - 1, top).to(torch.int8), sx


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] int8 in -8..7 (the inverse of compressed-tensors' pack_to_int32 at 4 bits)."""
    k = torch.arange(in_features, device=packed.device)
    return (((packed[:, k // 8] >> ((k % 8) * 4)) & 0xF) - 8).to(torch.int8)


def w4a8_reference(xq: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, N] fp32: sum over groups g of (xq[:, g] @ W[:, g].T) * scales[:, g], times sx per row (exact
    integer sums: float64 holds them)."""
    n, groups = scales.shape
    k = xq.size(1)
    w = unpack_int4(packed, k).double().reshape(n, groups, k // groups)
    x = xq.double().reshape(-1, groups, k // groups)
    acc = torch.einsum("mgk,ngk->mng", x, w)
    return ((acc * scales.double()).sum(-1) * sx.double()[:, None]).float()


@jit_cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x_ptr, sx_ptr, w_ptr, s_ptr, o_ptr, M, N, K, GROUP, stride_xm, stride_wn, stride_sn, stride_om,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for g0 in range(0, K, GROUP):
            acc_g = tl.zeros([BM, BN], dtype=tl.int32)
            for k0 in range(g0, g0 + GROUP, BK):
                k = k0 + rk
                x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :], mask=(rm < M)[:, None],
                            other=0)
                p = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k[:, None] // 8),
                            mask=(rn < N)[None, :], other=0)
                w = (((p >> ((k[:, None] % 8) * 4)) & 0xF) - 8).to(tl.int8)
                acc_g = tl.dot(x, w, acc_g, out_dtype=tl.int32)
            s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + g0 // GROUP, mask=rn < N, other=0.0)
            acc += acc_g.to(tl.float32) * s[None, :]
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
        tl.store(o_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc * sx[:, None],
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

    return gemm


def w4a8_matmul(xq: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of `w4a8_reference` (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    import triton
    m, k = xq.shape
    n, groups = scales.shape
    group = k // groups
    if k % 8 or group * groups != k or group % 16 or packed.shape != (n, k // 8):
        raise ValueError(f"w4a8_matmul: K={k} must split into {groups} groups of a multiple of 16 columns, packed "
                         f"[{n}, {k // 8}] int32 (got {tuple(packed.shape)})")
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn, bk = 64, max(16, min(128, group & -group))  # bk: the largest power of 2 dividing the group, <= 128
    out = torch.empty(m, n, device=xq.device, dtype=torch.float32)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    scales = scales.float().contiguous()
    _kernel()[grid](xq.contiguous(), sx.float().contiguous(), packed.contiguous(), scales, out, m, n, k, group,
                    k, packed.stride(0), scales.stride(0), n, BM=bm, BN=bn, BK=bk)
    return out
