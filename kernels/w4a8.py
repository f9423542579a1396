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
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
        # SPLIT_K > 1: each program sums its share of the groups into the zeroed output with atomics (a decode
        # step's few rows leave too few column tiles to keep the memory system busy)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)  # columns on the first axis: many more of them than rows
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        rk = tl.arange(0, BK)
        rc = tl.arange(0, BK // 8)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        per = tl.cdiv(K // GROUP, SPLIT_K) * GROUP
        for g0 in range(tl.program_id(2) * per, tl.minimum(K, tl.program_id(2) * per + per), GROUP):
            acc_g = tl.zeros([BM, BN], dtype=tl.int32)
            for k0 in range(g0, g0 + GROUP, BK):
                x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                            mask=(rm < M)[:, None], other=0)
                p = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // 8 + rc)[None, :],
                            mask=(rn < N)[:, None], other=0)
                # nibble j of packed column c is weight 8c + j: joins stack the eight nibbles in registers (the
                # last three joined dimensions index 4a + 2b + d), so each packed word is loaded once, K-contiguous
                a00 = tl.join(((p & 15) - 8).to(tl.int8), (((p >> 16) & 15) - 8).to(tl.int8))
                a01 = tl.join((((p >> 4) & 15) - 8).to(tl.int8), (((p >> 20) & 15) - 8).to(tl.int8))
                a10 = tl.join((((p >> 8) & 15) - 8).to(tl.int8), (((p >> 24) & 15) - 8).to(tl.int8))
                a11 = tl.join((((p >> 12) & 15) - 8).to(tl.int8), (((p >> 28) & 15) - 8).to(tl.int8))
                w = tl.reshape(tl.join(tl.join(a00, a10), tl.join(a01, a11)), [BN, BK])
                acc_g = tl.dot(x, tl.trans(w), acc_g, out_dtype=tl.int32)
            s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + g0 // GROUP, mask=rn < N, other=0.0)
            acc += acc_g.to(tl.float32) * s[None, :]
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
        optr = o_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        if SPLIT_K == 1:
            tl.store(optr, acc * sx[:, None], mask=(rm < M)[:, None] & (rn < N)[None, :])
        else:
            tl.atomic_add(optr, acc * sx[:, None], mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def quantize(x_ptr, q_ptr, s_ptr, K, stride_xm, TOP: tl.constexpr, BLOCK: tl.constexpr):
        # one row: absmax scale, then round half to even as torch.round does (adding and taking away 1.5 * 2^23
        # leaves fp32 no fraction bits: exact for |v| <= 2^22, far above 127)
        row = tl.program_id(0)
        rk = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        sx = tl.maximum(tl.max(tl.abs(x), 0) / TOP, 1e-8)
        r = (x / sx + 12582912.0) - 12582912.0
        tl.store(q_ptr + row.to(tl.int64) * K + rk, tl.minimum(tl.maximum(r, -TOP - 1), TOP).to(tl.int8), mask=rk < K)
        tl.store(s_ptr + row + tl.arange(0, 1), tl.full([1], 0.0, tl.float32) + sx)

    return gemm, quantize


def quantize_activations_fused(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` in one Triton launch (torch's form takes six: at a decode step they cost more than
    the GEMM)."""
    import triton
    x = x.contiguous()
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    sx = torch.empty(m, dtype=torch.float32, device=x.device)
    _kernel()[1][(m,)](x, xq, sx, k, x.stride(0), TOP=2 ** (bits - 1) - 1, BLOCK=triton.next_power_of_2(k))
    return xq, sx


def w4a8_matmul(xq: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """The Triton kernel of `w4a8_reference` (CUDA tensors, or CPU under TRITON_INTERPRET=1). `config` overrides
    the tile sizes and launch settings (BM, BN, BK, SPLIT_K, num_warps, num_stages), for benchmarks."""
    import triton
    m, k = xq.shape
    n, groups = scales.shape
    group = k // groups
    if k % 8 or group * groups != k or group % 16 or packed.shape != (n, k // 8):
        raise ValueError(f"w4a8_matmul: K={k} must split into {groups} groups of a multiple of 16 columns, packed "
                         f"[{n}, {k // 8}] int32 (got {tuple(packed.shape)})")
    # the fastest split-free tiles of a sweep on an H100 at 4096 -> 14336. SPLIT_K 8 was faster at up to 16 rows
    # (40 against 53 us) but its atomics make the sums' order, so a greedy decode, vary from run to run
    cfg = dict(BM=16 if m <= 16 else 32 if m <= 32 else 64, BN=32 if m <= 64 else 128,
               BK=max(16, min(128, group & -group)), SPLIT_K=1, num_warps=4, num_stages=2)
    cfg.update(config or {})  # BK above: the largest power of 2 dividing the group, <= 128
    split = cfg["SPLIT_K"]
    out = (torch.zeros if split > 1 else torch.empty)(m, n, device=xq.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), split)
    scales = scales.float().contiguous()
    _kernel()[0][grid](xq.contiguous(), sx.float().contiguous(), packed.contiguous(), scales, out, m, n, k, group,
                       k, packed.stride(0), scales.stride(0), n, **cfg)
    return out
