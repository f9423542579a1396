"""W4A8 GEMM: int4 group-quantized weights, packed as compressed-tensors packs them (8 signed nibbles per
int32 along the input dimension, stored +8), times int8 per-token activations; int32 accumulation per group,
rescaled by the group's weight scale and the token's activation scale. One kernel serves a dense layer and a
mixture-of-experts layer's routed experts (`w4a8_grouped`: rows sorted by expert, every expert in one launch).

torch has no int4 x int8 matmul (`torch._int_mm` is int8 x int8 and needs the weights unpacked, 2x the
bytes); the kernel reads the packed weights and unpacks them in registers, which is where the speed at small
batch comes from (the GEMM is bound by reading the weights). Three weight layouts (`kernel_layout`): "bytes"
wherever K and the group allow (two signed nibbles a byte, each plane one integer operation from a dot operand),
"planes" and compressed-tensors' own "nk" elsewhere (docs/kernels.md has the H200 sweep behind `default_config`).
The activations' per-token int8 quantization is one launch before the GEMM, or in its prologue (`fuse_quant`:
each program takes its rows' absolute maximum itself and quantizes each tile as it loads it; off by default, since
every split-K program re-quantizing its rows took 3x the separate launch's time on the H200, 6x on the H100).
Split-K (more programs than column tiles, for the few rows of a decode step) writes per-split partial sums that one
`sum` adds in a fixed order: the result is the same from run to run (atomics would let a greedy decode vary)."""
from __future__ import annotations

import torch

from kernels import jit_cache


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: (xq [M, K] int8, scale [M] fp32), x ~= xq * scale[:, None]."""
    top = 2 ** (bits - 1) - 1
    amax = x.float().abs().amax(-1)
    # a tensor divisor: CUDA divides by a Python number as a multiplication by its reciprocal, which can round the
    # scale one ulp away from the kernel's correctly rounded division (and flip an activation at a half)
    sx = (amax / torch.full_like(amax, top)).clamp(min=1e-8)
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
    from kernels import w4a8_triton
    return w4a8_triton.gemm, w4a8_triton.quantize


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


LAYOUTS = ("nk", "planes", "bytes")  # the kernel's LAYOUT constant is the index


def layout_for(k: int, group: int, layout: str = "planes") -> str:
    """`layout` for a [N, K] layer where K allows it, else compressed-tensors' "nk". "planes" needs K in blocks of
    256 and groups of a multiple of 32 that either divide 256 or are made of whole blocks; "bytes" K in blocks of
    256 and groups of 32, 64 or a multiple of 128."""
    if layout == "planes":
        fits = k % 256 == 0 and group % 32 == 0 and (256 % group == 0 or group % 256 == 0)
    elif layout == "bytes":
        fits = k % 256 == 0 and (group in (32, 64) or group % 128 == 0)
    else:
        fits = True
    return layout if fits else "nk"


def kernel_layout(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """compressed-tensors' packed weights ([..., N, K/8] int32) in a kernel layout (made once per layer): "nk" as
    they are; "planes" [..., K/8, N] int32, in each block of 256 columns nibble j of word c holding column 32j + c;
    "bytes" [..., N, K/2] int8, in each block of 256 columns byte c holding column c (low nibble) and 128 + c (high
    nibble), signed."""
    if layout == "nk":
        return packed.contiguous()
    n, k = packed.shape[-2], packed.shape[-1] * 8
    if layout == "bytes":
        v = unpack_int4(packed, k).to(torch.int16).reshape(*packed.shape[:-2], n, k // 256, 2, 128)
        byte = (v[..., 0, :] & 0xF) | ((v[..., 1, :] & 0xF) << 4)
        return byte.to(torch.uint8).view(torch.int8).reshape(*packed.shape[:-2], n, k // 2).contiguous()
    v = (unpack_int4(packed, k).to(torch.int64) + 8).reshape(*packed.shape[:-2], n, k // 256, 8, 32)
    word = (v << (torch.arange(8, device=packed.device) * 4)[:, None]).sum(-2)  # [..., N, K/256, 32]
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).reshape(*packed.shape[:-2], n, k // 8)
    return word.transpose(-2, -1).contiguous()


def default_config(m: int, k: int, group: int, fuse_quant: bool = False, grouped: bool = False) -> dict:
    """Tiles and launch settings by rows (rows per expert for a grouped launch), from bench/kernels' sweep on an
    H200 (docs/kernels.md). Where K and the group fit it, the "bytes" layout with inline PTX (on a GPU): up to 16
    rows the transposed product over 256 columns with split-K 4 (a grouped launch: 128 columns, split-K 1, its
    experts already fill the GPU), beyond it 64-row tiles. Elsewhere "planes" up to 16 rows with split-K 8 and
    compressed-tensors' layout beyond. BK is the largest power of 2 dividing the group, <= 128."""
    few = m <= 16
    cfg = dict(BM=16 if few else 32 if m <= 32 else 64, BN=128 if few or m > 64 else 64,
               SPLIT_K=(1 if grouped else 8) if few else 1, num_warps=4, num_stages=3, fuse_quant=fuse_quant,
               layout=layout_for(k, group) if few else "nk", swap=False, asm=False,
               BK=max(16, min(128, group & -group)))
    if layout_for(k, group, "bytes") != "bytes":
        return cfg
    cfg.update(layout="bytes", asm=True, BK=128, swap=not grouped)
    if few and not grouped:
        cfg.update(BN=256, SPLIT_K=4, num_stages=2)
    elif not few:
        cfg.update(BN=128 if m <= 128 else 64, num_warps=8)
    return cfg


def _launch(x, sx, packed, scales, out_rows: int, blocks, grid_m: int, cfg: dict) -> torch.Tensor:
    import triton
    from kernels import interpreting
    grouped = blocks is not None
    e_dims = 1 if grouped else 0
    n, groups = scales.shape[-2:]
    k = x.size(1)
    group = k // groups
    cfg = dict(cfg)
    split, fuse, layout = cfg.pop("SPLIT_K"), cfg.pop("fuse_quant"), cfg.pop("layout")
    swap, asm = cfg.pop("swap", False), cfg.pop("asm", False) and not interpreting()  # no inline PTX interpreted
    want = {"planes": ((k // 8, n), torch.int32), "bytes": ((n, k // 2), torch.int8)}.get(layout, ((n, k // 8),
                                                                                                    torch.int32))
    if (k % 8 or group * groups != k or group % 16 or (tuple(packed.shape[-2:]), packed.dtype) != want
            or layout_for(k, group, layout) != layout):
        raise ValueError(f"w4a8: K={k} must split into {groups} groups of a multiple of 16 columns, packed "
                         f"{list(want[0])} {want[1]} in the {layout} layout (kernel_layout, layout_for; got "
                         f"{tuple(packed.shape)} {packed.dtype})")
    if layout == "bytes":  # a step's columns within one group
        cfg["BK"] = min(cfg["BK"], 128, group)
        steps_per_scale = max(1, min(group, 128) // cfg["BK"])
    else:
        steps_per_scale = min(8, group // 32) if layout == "planes" else 1
    split = max(1, min(split, k // 256 if layout != "nk" else groups))
    out = torch.empty(split, out_rows, n, device=x.device, dtype=torch.float32)
    scales = scales.float().contiguous()
    packed = packed.contiguous()
    grid = (triton.cdiv(n, cfg["BN"]), grid_m, split)
    _kernel()[0][grid](x, x if sx is None else sx, packed, scales, out, x if blocks is None else blocks, out_rows, n,
                       k, group, x.stride(0), packed.stride(0) if e_dims else 0, packed.stride(-2),
                       scales.stride(0) if e_dims else 0, scales.stride(-2), out.stride(0), out.stride(1),
                       SPLIT_K=split, FUSE_QUANT=fuse, GROUPED=grouped, LAYOUT=LAYOUTS.index(layout),
                       STEPS_PER_SCALE=steps_per_scale, SWAP=swap and layout == "bytes", ASM=asm, **cfg)
    return out[0] if split == 1 else out.sum(0)  # a fixed order: deterministic


def w4a8_matmul(xq: torch.Tensor, sx: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """The Triton kernel of `w4a8_reference` on activations already quantized (CUDA tensors, or CPU under
    TRITON_INTERPRET=1), `packed` in `kernel_layout`. `config` overrides the tiles and launch settings (BM, BN, BK,
    SPLIT_K, num_warps, num_stages, layout, swap, asm), for benchmarks."""
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
