"""W4A8 GEMM: int4 group-quantized weights, packed as compressed-tensors packs them (8 signed nibbles per
int32 along the input dimension, stored +8), times int8 per-token activations; int32 accumulation per group,
rescaled by the group's weight scale and the token's activation scale. One kernel serves a dense layer and a
mixture-of-experts layer's routed experts (`w4a8_grouped`: rows sorted by expert, every expert in one launch).

torch has no int4 x int8 matmul (`torch._int_mm` is int8 x int8 and needs the weights unpacked, 2x the
bytes); the kernel reads the packed weights and unpacks them in registers, which is where the speed at small
batch comes from (the GEMM is bound by reading the weights). Two weight layouts (`kernel_layout`): "planes" for
up to 16 rows, compressed-tensors' own ("nk") beyond (docs/kernels.md has the H100 sweep behind `default_config`).
The activations' per-token int8 quantization is one launch before the GEMM, or in its prologue (`fuse_quant`:
each program takes its rows' absolute maximum itself and quantizes each tile as it loads it; off by default, since
on the H100 every split-K program re-quantizing its rows took 6x the time of the separate launch). Split-K (more
programs than column tiles, for the few rows of a decode step) writes per-split partial sums that one `sum` adds
in a fixed order: the result is the same from run to run (atomics would let a greedy decode vary)."""
from __future__ import annotations

import torch

from kernels import jit_cache


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: (xq [M, K] int8, scale [M] fp32), x ~= xq * scale[:, None]."""
    top = 2 ** (bits - 1) - 1
    sx = (x.float().abs().amax(-1) / top).clamp(min=1e-8)
    return torch.round(x.float() / sx[:, None]).clamp(-top - 1, top).to(torch.int8), sx


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[..., N, K/8] int32 -> [..., N, K] int8 in -8..7 (the inverse of compressed-tensors' pack_to_int32 at 4 bits)."""
    k = torch.arange(in_features, device=packed.device)
    return (((packed[..., k // 8] >> ((k % 8) * 4)) & 0xF) - 8).to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., N, K] int in -8..7 -> [..., N, K/8] int32, compressed-tensors' packing (nibble j of word c is column
    8c + j, stored +8); here so the kernels and their benchmark need no compressed-tensors."""
    u = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    word = (u << (torch.arange(8, device=q.device) * 4)).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def w4a8_reference(xq: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, N] fp32: sum over groups g of (xq[:, g] @ W[:, g].T) * scales[:, g], times sx per row (exact
    integer sums: float64 holds them)."""
    n, groups = scales.shape
    k = xq.size(1)
    w = unpack_int4(packed, k).double().reshape(n, groups, k // groups)
    x = xq.double().reshape(-1, groups, k // groups)
    acc = torch.einsum("mgk,ngk->mng", x, w)
    return ((acc * scales.double()).sum(-1) * sx.double()[:, None]).float()


def w4a8_grouped_reference(x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor,
                           scales: torch.Tensor) -> torch.Tensor:
    """Rows `offsets[e]:offsets[e+1]` of `x` [rows, K] (float, quantized per token here) through expert e's
    weights `packed[e]`, `scales[e]`: [rows, N] fp32, the loop over experts the grouped kernel replaces."""
    xq, sx = quantize_activations(x)
    out = torch.zeros(x.size(0), scales.size(1), dtype=torch.float32, device=x.device)
    bounds = offsets.tolist()
    for e in range(packed.size(0)):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            out[a:b] = w4a8_reference(xq[a:b], sx[a:b], packed[e], scales[e])
    return out


@jit_cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x_ptr, sx_ptr, w_ptr, s_ptr, o_ptr, blocks_ptr, M, N, K, GROUP,
             stride_xm, stride_we, stride_w, stride_se, stride_sn, stride_os, stride_om,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
             FUSE_QUANT: tl.constexpr, GROUPED: tl.constexpr, PLANES: tl.constexpr, PLANES_PER_SCALE: tl.constexpr):
        pid_m = tl.program_id(1)
        if GROUPED:  # the block table: this block's expert and rows (an expert's rows are contiguous)
            expert = tl.load(blocks_ptr + pid_m * 3)
            row0 = tl.load(blocks_ptr + pid_m * 3 + 1)
            row_end = tl.load(blocks_ptr + pid_m * 3 + 2)
        else:  # a tensor like the grouped branch's (stride_we is 0)
            expert = pid_m * 0
            row0 = pid_m * BM
            row_end = M
        if expert >= 0:  # a grouped launch has more blocks than it needs (its grid is sized without a sync)
            rn = tl.program_id(0) * BN + tl.arange(0, BN)  # columns on the first axis: more of them than rows
            rm = row0 + tl.arange(0, BM)
            live = rm < row_end
            rk = tl.arange(0, BK)
            x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
            if FUSE_QUANT:  # the rows' absolute maximum, as quantize_activations takes it (they stay in cache)
                amax = tl.zeros([BM], dtype=tl.float32)
                for k0 in range(0, K, BK):
                    xf = tl.load(x_rows + (k0 + rk)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.max(tl.abs(xf), 1))
                sx = tl.maximum(tl.div_rn(amax, 127.0), 1e-8)
            else:
                sx = tl.load(sx_ptr + rm, mask=live, other=0.0)
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_rows = s_ptr + expert.to(tl.int64) * stride_se + rn.to(tl.int64) * stride_sn
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            if PLANES:
                # the "planes" layout ([K/8, N] words; in each block of 256 columns, nibble j of word c is column
                # 32j + c): a block's eight nibble planes are eight [32, N] int8 tiles, each one tl.dot's operand as
                # it is (two integer operations per weight, no register shuffles). Nibbles stay unsigned (0..15):
                # sum x (v - 8) = sum x v - 8 sum x, the correction one sum over the activations.
                rp = tl.arange(0, 32)
                per = tl.cdiv(K // 256, SPLIT_K) * 256
                for k0 in range(tl.program_id(2) * per, tl.minimum(K, tl.program_id(2) * per + per), 256):
                    p = tl.load(w_base + (k0 // 8 + rp)[:, None].to(tl.int64) * stride_w + rn[None, :],
                                mask=(rn < N)[None, :], other=0)
                    acc_g = tl.zeros([BM, BN], dtype=tl.int32)
                    xsum = tl.zeros([BM], dtype=tl.int32)
                    for j in tl.static_range(8):
                        cols = k0 + 32 * j + rp
                        if FUSE_QUANT:  # round half to even as torch.round: 1.5 * 2^23 leaves fp32 no fraction bits
                            xf = tl.load(x_rows + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                            r = (tl.div_rn(xf, sx[:, None]) + 12582912.0) - 12582912.0
                            x = tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)
                        else:
                            x = tl.load(x_rows + cols[None, :], mask=live[:, None], other=0)
                        xsum += tl.sum(x.to(tl.int32), 1)
                        acc_g = tl.dot(x, ((p >> (4 * j)) & 15).to(tl.int8), acc_g, out_dtype=tl.int32)
                        if (j + 1) % PLANES_PER_SCALE == 0:
                            s = tl.load(s_rows + (k0 + 32 * j) // GROUP, mask=rn < N, other=0.0)
                            acc += (acc_g - 8 * xsum[:, None]).to(tl.float32) * s[None, :]
                            acc_g = tl.zeros([BM, BN], dtype=tl.int32)
                            xsum = tl.zeros([BM], dtype=tl.int32)
            else:
                # compressed-tensors' [N, K/8]: nibble j of packed column c is weight 8c + j; joins stack the eight
                # nibbles in registers (the last three joined dimensions index 4a + 2b + d)
                rc = tl.arange(0, BK // 8)
                per = tl.cdiv(K // GROUP, SPLIT_K) * GROUP
                for g0 in range(tl.program_id(2) * per, tl.minimum(K, tl.program_id(2) * per + per), GROUP):
                    acc_g = tl.zeros([BM, BN], dtype=tl.int32)
                    for k0 in range(g0, g0 + GROUP, BK):
                        if FUSE_QUANT:
                            xf = tl.load(x_rows + (k0 + rk)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                            r = (tl.div_rn(xf, sx[:, None]) + 12582912.0) - 12582912.0
                            x = tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)
                        else:
                            x = tl.load(x_rows + (k0 + rk)[None, :], mask=live[:, None], other=0)
                        p = tl.load(w_base + rn[:, None].to(tl.int64) * stride_w + (k0 // 8 + rc)[None, :],
                                    mask=(rn < N)[:, None], other=0)
                        a00 = tl.join(((p & 15) - 8).to(tl.int8), (((p >> 16) & 15) - 8).to(tl.int8))
                        a01 = tl.join((((p >> 4) & 15) - 8).to(tl.int8), (((p >> 20) & 15) - 8).to(tl.int8))
                        a10 = tl.join((((p >> 8) & 15) - 8).to(tl.int8), (((p >> 24) & 15) - 8).to(tl.int8))
                        a11 = tl.join((((p >> 12) & 15) - 8).to(tl.int8), (((p >> 28) & 15) - 8).to(tl.int8))
                        w = tl.reshape(tl.join(tl.join(a00, a10), tl.join(a01, a11)), [BN, BK])
                        acc_g = tl.dot(x, tl.trans(w), acc_g, out_dtype=tl.int32)
                    s = tl.load(s_rows + g0 // GROUP, mask=rn < N, other=0.0)
                    acc += acc_g.to(tl.float32) * s[None, :]
            optr = o_ptr + tl.program_id(2).to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            tl.store(optr, acc * sx[:, None], mask=live[:, None] & (rn < N)[None, :])

    @triton.jit
    def quantize(x_ptr, q_ptr, s_ptr, K, stride_xm, TOP: tl.constexpr, BLOCK: tl.constexpr):
        # one row: absmax scale, then round half to even as torch.round does
        row = tl.program_id(0)
        rk = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        sx = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), TOP * 1.0), 1e-8)
        r = (tl.div_rn(x, sx) + 12582912.0) - 12582912.0
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


LAYOUT = "planes"  # the packed weights' layout in the kernel where K allows: "planes" or compressed-tensors' "nk"


def layout_for(k: int, group: int) -> str:
    """The kernel layout of a [N, K] layer: "planes" needs K in blocks of 256 and groups of a multiple of 32 that
    either divide 256 or are made of whole blocks."""
    fits = k % 256 == 0 and group % 32 == 0 and (256 % group == 0 or group % 256 == 0)
    return LAYOUT if fits else "nk"


def kernel_layout(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """compressed-tensors' packed weights ([..., N, K/8] int32) in a kernel layout (made once per layer): "nk" as
    they are; "planes" [..., K/8, N], in each block of 256 columns nibble j of word c holding column 32j + c."""
    if layout == "nk":
        return packed.contiguous()
    n, k = packed.shape[-2], packed.shape[-1] * 8
    v = (unpack_int4(packed, k).to(torch.int64) + 8).reshape(*packed.shape[:-2], n, k // 256, 8, 32)
    word = (v << (torch.arange(8, device=packed.device) * 4)[:, None]).sum(-2)  # [..., N, K/256, 32]
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).reshape(*packed.shape[:-2], n, k // 8)
    return word.transpose(-2, -1).contiguous()


def default_config(m: int, k: int, group: int, fuse_quant: bool = False, grouped: bool = False) -> dict:
    """Tiles and launch settings by rows (rows per expert for a grouped launch), from bench/kernels' sweep on an
    H100 (docs/kernels.md): up to 16 rows the "planes" layout with split-K 8 (1 for a grouped launch, whose experts
    already fill the GPU); beyond, compressed-tensors' layout, whose one K-128 dot per step beats eight K-32 ones.
    BK (the "nk" layout's step) is the largest power of 2 dividing the group, <= 128."""
    few = m <= 16
    cfg = dict(BM=16 if few else 32 if m <= 32 else 64, BN=128 if few or m > 64 else 64,
               SPLIT_K=(1 if grouped else 8) if few else 1, num_warps=4, num_stages=3, fuse_quant=fuse_quant,
               layout=layout_for(k, group) if few else "nk")
    cfg["BK"] = max(16, min(128, group & -group))
    return cfg


def _launch(x, sx, packed, scales, out_rows: int, blocks, grid_m: int, cfg: dict) -> torch.Tensor:
    import triton
    grouped = blocks is not None
    e_dims = 1 if grouped else 0
    n, groups = scales.shape[-2:]
    k = x.size(1)
    group = k // groups
    cfg = dict(cfg)
    split, fuse, layout = cfg.pop("SPLIT_K"), cfg.pop("fuse_quant"), cfg.pop("layout")
    planes = layout == "planes"
    want = (k // 8, n) if planes else (n, k // 8)
    if (k % 8 or group * groups != k or group % 16 or packed.shape[-2:] != want
            or (planes and layout_for(k, group) != "planes")):
        raise ValueError(f"w4a8: K={k} must split into {groups} groups of a multiple of 16 columns, packed "
                         f"{list(want)} int32 in the {layout} layout (kernel_layout, layout_for; got "
                         f"{tuple(packed.shape)})")
    split = max(1, min(split, k // 256 if planes else groups))
    out = torch.empty(split, out_rows, n, device=x.device, dtype=torch.float32)
    scales = scales.float().contiguous()
    packed = packed.contiguous()
    grid = (triton.cdiv(n, cfg["BN"]), grid_m, split)
    _kernel()[0][grid](x, x if sx is None else sx, packed, scales, out, x if blocks is None else blocks, out_rows, n,
                       k, group, x.stride(0), packed.stride(0) if e_dims else 0, packed.stride(-2),
                       scales.stride(0) if e_dims else 0, scales.stride(-2), out.stride(0), out.stride(1),
                       SPLIT_K=split, FUSE_QUANT=fuse, GROUPED=grouped, PLANES=planes,
                       PLANES_PER_SCALE=min(8, group // 32) if planes else 1, **cfg)
    return out[0] if split == 1 else out.sum(0)  # a fixed order: deterministic


def w4a8_matmul(xq: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """The Triton kernel of `w4a8_reference` on activations already quantized (CUDA tensors, or CPU under
    TRITON_INTERPRET=1), `packed` in `kernel_layout`. `config` overrides the tiles and launch settings (BM, BN, BK,
    SPLIT_K, num_warps, num_stages, layout), for benchmarks."""
    m, k = xq.shape
    cfg = {**default_config(m, k, k // scales.size(-1)), **(config or {}), "fuse_quant": False}
    return _launch(xq.contiguous(), sx.float().contiguous(), packed, scales, m, None,
                   -(-m // cfg["BM"]), cfg)


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] float -> [M, N] fp32: `w4a8_reference(*quantize_activations(x), packed, scales)` (`packed` in
    `kernel_layout`), the activations quantized in one launch before the GEMM, or in its prologue (`fuse_quant`)."""
    m, k = x.shape
    cfg = {**default_config(m, k, k // scales.size(-1)), **(config or {})}
    x = x.contiguous()
    if cfg["fuse_quant"]:
        return _launch(x, None, packed, scales, m, None, -(-m // cfg["BM"]), cfg)
    xq, sx = quantize_activations_fused(x)
    return _launch(xq, sx, packed, scales, m, None, -(-m // cfg["BM"]), cfg)


def block_table(offsets: torch.Tensor, bm: int, blocks: int) -> torch.Tensor:
    """[blocks, 3] int32 (expert, first row, the expert's end row) of each block of `bm` rows of a grouped launch,
    -1 past the last; computed on the device without a sync (`blocks` is an upper bound the host knows)."""
    offsets = offsets.to(torch.int64)
    count = offsets[1:] - offsets[:-1]
    per = (count + bm - 1) // bm
    ends = torch.cumsum(per, 0)
    b = torch.arange(blocks, device=offsets.device)
    e = torch.searchsorted(ends, b, right=True).clamp(max=count.numel() - 1)
    used = b < ends[-1]
    row0 = offsets[e] + (b - (ends[e] - per[e])) * bm
    table = torch.stack([torch.where(used, e, -1), row0, offsets[e + 1]], 1)
    return table.to(torch.int32).contiguous()


def w4a8_grouped(x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 config: dict | None = None) -> torch.Tensor:
    """A mixture-of-experts layer's routed experts in one launch: `x` [rows, K] float, sorted by expert, rows
    `offsets[e]:offsets[e+1]` going through expert e (`packed` [E, ...] int32 in `kernel_layout`, `scales`
    [E, N, groups]);
    [rows, N] fp32, `w4a8_grouped_reference`. Tiles by the mean rows per expert."""
    (rows, k), e = x.shape, packed.size(0)
    cfg = {**default_config(max(1, rows // e), k, k // scales.size(-1), grouped=True), **(config or {})}
    bm = cfg["BM"]
    blocks = -(-rows // bm) + e
    table = block_table(offsets.to(x.device), bm, blocks)
    x = x.contiguous()
    if cfg["fuse_quant"]:
        return _launch(x, None, packed, scales, rows, table, blocks, cfg)
    xq, sx = quantize_activations_fused(x)
    return _launch(xq, sx, packed, scales, rows, table, blocks, cfg)
