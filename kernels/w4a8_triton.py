"""The W4A8 GEMM's Triton code (`kernels.w4a8` is its interface, imported where triton may be absent: it imports
this module on first use). Three weight layouts (`LAYOUT`, the index in `kernels.w4a8.LAYOUTS`): compressed-tensors'
own ("nk"), "planes" and "bytes"; the docstrings of `kernels.w4a8.kernel_layout` say what each holds."""
import triton
import triton.language as tl


@triton.jit
def x_tile(ptrs, mask, sx, FUSE_QUANT: tl.constexpr):
    """An int8 activation tile: loaded as quantized, or quantized here from floats by `sx` (broadcastable),
    rounding half to even as torch.round (1.5 * 2^23 leaves fp32 no fraction bits)."""
    if FUSE_QUANT:
        xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        r = (tl.div_rn(xf, sx) + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(r, -128.0), 127.0).to(tl.int8)
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def nibbles(b, ASM: tl.constexpr):
    """A tile of "bytes"-layout weights -> its (low, high) nibble planes as int8 holding 16 x the signed weight:
    the high nibble is the byte with its low bits cleared, the low one the byte shifted up by 4. With `ASM` four
    bytes at a time (one 32-bit register: three integer operations per eight weights)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ shl.b32 $0, $2, 4; and.b32 $0, $0, 0xF0F0F0F0; and.b32 $1, $2, 0xF0F0F0F0; }",
            "=r,=r,r", [b], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        lo = b << 4
        hi = b & -16
        tl.static_assert(lo.dtype == tl.int8 and hi.dtype == tl.int8)
        return lo, hi


@triton.jit
def gemm(x_ptr, sx_ptr, w_ptr, s_ptr, o_ptr, blocks_ptr, M, N, K, GROUP,
         stride_xm, stride_we, stride_w, stride_se, stride_sn, stride_os, stride_om,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
         FUSE_QUANT: tl.constexpr, GROUPED: tl.constexpr, LAYOUT: tl.constexpr, STEPS_PER_SCALE: tl.constexpr,
         SWAP: tl.constexpr, ASM: tl.constexpr):
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
        if SWAP:  # the transposed product: weights as the dot's first operand, out^T = W x^T
            acc = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        if LAYOUT == 2:
            # "bytes" ([N, K/2] int8; in each block of 256 columns byte c holds column c in its low nibble and
            # column 128 + c in its high one, signed): a step's [BN, BK] bytes are two [BN, BK] int8 dot operands
            # of 16 x the weights after one integer operation each (the 1/16 goes into the rescale)
            per = tl.cdiv(K // 256, SPLIT_K) * 256
            w_rows = w_base + rn[:, None].to(tl.int64) * stride_w
            for k0 in range(tl.program_id(2) * per, tl.minimum(K, tl.program_id(2) * per + per), 256):
                if SWAP:
                    acc_lo = tl.zeros([BN, BM], dtype=tl.int32)
                else:
                    acc_lo = tl.zeros([BM, BN], dtype=tl.int32)
                acc_hi = acc_lo
                for j in tl.static_range(128 // BK):
                    b = tl.load(w_rows + (k0 // 2 + j * BK + rk)[None, :], mask=(rn < N)[:, None], other=0)
                    lo, hi = nibbles(b, ASM)
                    c_lo = k0 + j * BK + rk
                    if SWAP:
                        xt = x_ptr + rm[None, :].to(tl.int64) * stride_xm
                        x_lo = x_tile(xt + c_lo[:, None], live[None, :], sx[None, :], FUSE_QUANT)
                        x_hi = x_tile(xt + (c_lo + 128)[:, None], live[None, :], sx[None, :], FUSE_QUANT)
                        acc_lo = tl.dot(lo, x_lo, acc_lo, out_dtype=tl.int32)
                        acc_hi = tl.dot(hi, x_hi, acc_hi, out_dtype=tl.int32)
                    else:
                        x_lo = x_tile(x_rows + c_lo[None, :], live[:, None], sx[:, None], FUSE_QUANT)
                        x_hi = x_tile(x_rows + (c_lo + 128)[None, :], live[:, None], sx[:, None], FUSE_QUANT)
                        acc_lo = tl.dot(x_lo, tl.trans(lo), acc_lo, out_dtype=tl.int32)
                        acc_hi = tl.dot(x_hi, tl.trans(hi), acc_hi, out_dtype=tl.int32)
                    if (j + 1) % STEPS_PER_SCALE == 0:
                        s_lo = tl.load(s_rows + (k0 + j * BK) // GROUP, mask=rn < N, other=0.0)
                        s_hi = tl.load(s_rows + (k0 + 128 + j * BK) // GROUP, mask=rn < N, other=0.0)
                        if SWAP:
                            acc += acc_lo.to(tl.float32) * s_lo[:, None] + acc_hi.to(tl.float32) * s_hi[:, None]
                        else:
                            acc += acc_lo.to(tl.float32) * s_lo[None, :] + acc_hi.to(tl.float32) * s_hi[None, :]
                        acc_lo = tl.zeros_like(acc_lo)
                        acc_hi = tl.zeros_like(acc_lo)
            sx = sx * 0.0625
        elif LAYOUT == 1:
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
                    x = x_tile(x_rows + (k0 + 32 * j + rp)[None, :], live[:, None], sx[:, None], FUSE_QUANT)
                    xsum += tl.sum(x.to(tl.int32), 1)
                    acc_g = tl.dot(x, ((p >> (4 * j)) & 15).to(tl.int8), acc_g, out_dtype=tl.int32)
                    if (j + 1) % STEPS_PER_SCALE == 0:
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
                    x = x_tile(x_rows + (k0 + rk)[None, :], live[:, None], sx[:, None], FUSE_QUANT)
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
        o_base = o_ptr + tl.program_id(2).to(tl.int64) * stride_os
        if SWAP:
            tl.store(o_base + rm[None, :].to(tl.int64) * stride_om + rn[:, None], acc * sx[None, :],
                     mask=live[None, :] & (rn < N)[:, None])
        else:
            tl.store(o_base + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc * sx[:, None],
                     mask=live[:, None] & (rn < N)[None, :])


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

