"""DeepSeek Sparse Attention's two kernels: the lightning indexer's scores + top-k, and attention over the selected
keys only. Each beside a plain-torch reference.

Shapes: index queries `qi` [B, Lq, HI, D] and head weights `w` [B, Lq, HI] (from the hidden states), index keys
`ki` [B, Lk, D]; `allowed` [B, Lq, Lk] bool (causal and document mask; None: causal, queries right-aligned to
the keys as in decoding). The score of key s for query t is  sum_j w[t, j] * relu(qi[t, j] . ki[s]) / sqrt(D),
the DeepSeek design: a few cheap heads, ReLU, weighted per query. `idx` [B, Lq, K] int32 holds the selected keys
(-1 where fewer than K are allowed); one selection serves every head of the layer (and, with IndexShare, the
next layers).
"""
from __future__ import annotations

import math

import torch

from kernels import jit_cache, use_triton


def causal(lq: int, lk: int, device=None) -> torch.Tensor:
    """[Lq, Lk] bool: query t (right-aligned: position lk - lq + t) sees keys up to its own position."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


def indexer_scores(qi: torch.Tensor, w: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
    """[B, Lq, Lk] fp32 index scores (no mask)."""
    dots = torch.einsum("bqhd,bkd->bqhk", qi.float(), ki.float()).relu()
    return torch.einsum("bqhk,bqh->bqk", dots, w.float()) / math.sqrt(qi.shape[-1])


def indexer_topk_reference(qi, w, ki, allowed, top_k: int) -> torch.Tensor:
    scores = indexer_scores(qi, w, ki)
    allowed = causal(qi.shape[1], ki.shape[1], qi.device) if allowed is None else allowed
    scores = scores.masked_fill(~allowed, float("-inf")).flip(-1)
    # equal scores (ReLU makes exact zeros common) go to the later key, as in the kernel: a stable sort of the
    # reversed keys, so the choice does not depend on where a packed document starts
    vals, idx = scores.sort(dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :top_k], scores.shape[-1] - 1 - idx[..., :top_k]
    idx = idx.masked_fill(vals == float("-inf"), -1).int()
    if idx.shape[-1] < top_k:
        idx = torch.nn.functional.pad(idx, (0, top_k - idx.shape[-1]), value=-1)
    return idx


def selected_mask(idx: torch.Tensor, lk: int) -> torch.Tensor:
    """[B, Lq, Lk] bool from `idx` (its -1 entries select nothing)."""
    sel = torch.zeros(*idx.shape[:-1], lk + 1, dtype=torch.bool, device=idx.device)
    sel.scatter_(-1, idx.long().masked_fill(idx < 0, lk), True)
    return sel[..., :lk]


def sparse_attention_reference(q, k, v, idx, scaling: float) -> torch.Tensor:
    """[B, H, Lq, D]: softmax attention of each query over its selected keys only (dense math under a mask; rows
    that select nothing give zeros). Key/value heads are shared by groups of query heads (GQA)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sel = selected_mask(idx, k.shape[2])[:, None]
    s = (q.float() @ k.float().transpose(-1, -2) * scaling).masked_fill(~sel, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype)


def sparse_attention_gather(q, k, v, idx, scaling: float, chunk: int = 256) -> torch.Tensor:
    """The same in torch, O(Lq * K) not O(Lq * Lk): per chunk of queries the selected keys are gathered once per
    key head and shared by its query heads."""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, lq, d)
    out = torch.empty_like(qg)
    for c in range(0, lq, chunk):
        ids = idx[:, c:c + chunk].long()                                   # [B, C, K]
        n, kk_ = ids.shape[1], ids.shape[2]
        flat = ids.clamp(min=0).flatten(1)[:, None, :, None].expand(-1, hkv, -1, d)
        kk = k.gather(2, flat).view(b, hkv, n, kk_, d)
        vv = v.gather(2, flat).view(b, hkv, n, kk_, d)
        s = torch.einsum("bngcd,bnckd->bngck", qg[:, :, :, c:c + chunk], kk) * scaling
        p = torch.softmax(s.masked_fill((ids < 0)[:, None, None], float("-inf")), -1).nan_to_num(0.0)
        out[:, :, :, c:c + chunk] = torch.einsum("bngck,bnckd->bngcd", p, vv)
    return out.view(b, h, lq, d)


@jit_cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def topk_kernel(qi_ptr, w_ptr, ki_ptr, a_ptr, idx_ptr, LQ, LK, D, HI, OFFSET, scale,
                    s_qb, s_qt, s_qh, s_wb, s_wt, s_kb, s_kt, s_ab, s_at, s_ib, s_it,
                    HAS_MASK: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, TOPK: tl.constexpr):
        # Scores for BM queries against key blocks of TOPK; a running top-TOPK per query merged with each block.
        # Score and key index travel as one int64 (order-preserving int32 of the fp32 score, then the index), so
        # tl.topk, which sorts values only, carries the indices along.
        b = tl.program_id(0)
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        rd = tl.arange(0, BD)
        rn0 = tl.arange(0, TOPK)
        floor = tl.full([BM, TOPK], -2 ** 63, tl.int64)
        best = floor
        hi = tl.minimum(LK, tl.program_id(1) * BM + BM + OFFSET)  # no query in the block sees past this key
        for start in range(0, hi, TOPK):
            rn = start + rn0
            kk = tl.load(ki_ptr + b * s_kb + rn[:, None].to(tl.int64) * s_kt + rd[None, :],
                         mask=(rn < LK)[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)
            s = tl.zeros([BM, TOPK], dtype=tl.float32)
            for h in range(0, HI):
                q = tl.load(qi_ptr + b * s_qb + rm[:, None].to(tl.int64) * s_qt + h * s_qh + rd[None, :],
                            mask=(rm < LQ)[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)
                wh = tl.load(w_ptr + b * s_wb + rm.to(tl.int64) * s_wt + h, mask=rm < LQ, other=0.0).to(tl.float32)
                s += wh[:, None] * tl.maximum(tl.dot(q, tl.trans(kk), input_precision="ieee"), 0.0)
            s = s * scale
            ok = (rm < LQ)[:, None] & (rn < LK)[None, :]
            if HAS_MASK:
                ok &= tl.load(a_ptr + b * s_ab + rm[:, None].to(tl.int64) * s_at + rn[None, :], mask=ok, other=0) != 0
            else:
                ok &= rn[None, :] <= rm[:, None] + OFFSET
            bits = s.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
            packed = tl.where(ok, (key << 32) | rn[None, :].to(tl.int64), floor)
            both = tl.reshape(tl.join(best, packed), [BM, 2 * TOPK])
            best = tl.topk(both, TOPK)
        ids = tl.where(best == floor, -1, (best & 0xFFFFFFFF).to(tl.int32))
        tl.store(idx_ptr + b * s_ib + rm[:, None].to(tl.int64) * s_it + rn0[None, :], ids, mask=(rm < LQ)[:, None])

    @triton.jit
    def attn_fwd(q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr, H, G, LQ, D, K, scale,
                 s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_ib, s_it, BK: tl.constexpr, BD: tl.constexpr):
        # one program per (batch x head, query): online softmax over its selected keys, BK at a time
        bh, t = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rd = tl.arange(0, BD)
        q = tl.load(q_ptr + b * s_qb + h * s_qh + t * s_qt + rd, mask=rd < D, other=0.0).to(tl.float32)
        kbase = b * s_kb + (h // G) * s_kh
        m = tl.full([1], -float("inf"), tl.float32)  # [1]: loop-carried running max and sum
        l = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BD], dtype=tl.float32)
        for c in range(0, K, BK):
            rk = c + tl.arange(0, BK)
            ids = tl.load(idx_ptr + b * s_ib + t * s_it + rk, mask=rk < K, other=-1)
            ok = ids >= 0
            off = kbase + ids[:, None].to(tl.int64) * s_kt + rd[None, :]
            kk = tl.load(k_ptr + off, mask=ok[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)
            vv = tl.load(v_ptr + off, mask=ok[:, None] & (rd < D)[None, :], other=0.0).to(tl.float32)
            s = tl.where(ok, tl.sum(kk * q[None, :], 1) * scale, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp(s - safe)
            alpha = tl.exp(m - safe)
            l = l * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * vv, 0)
            m = m_new
        o = tl.where(l > 0, acc / l, 0.0)
        tl.store(o_ptr + b * s_qb + h * s_qh + t * s_qt + rd, o, mask=rd < D)
        tl.store(lse_ptr + bh * LQ + t + tl.arange(0, 1), tl.where(l > 0, m + tl.log(l), float("inf")))

    @triton.jit
    def attn_bwd(q_ptr, k_ptr, v_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, H, G, LQ, D, K,
                 scale, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_ib, s_it, BK: tl.constexpr, BD: tl.constexpr):
        # recompute p from the saved log-sum-exp; dq in registers, dk and dv scattered with atomics (a key is
        # selected by many queries)
        bh, t = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rd = tl.arange(0, BD)
        qoff = b * s_qb + h * s_qh + t * s_qt + rd
        q = tl.load(q_ptr + qoff, mask=rd < D, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + qoff, mask=rd < D, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + bh * LQ + t)
        delta = tl.load(delta_ptr + bh * LQ + t)
        kbase = b * s_kb + (h // G) * s_kh
        dq = tl.zeros([BD], dtype=tl.float32)
        for c in range(0, K, BK):
            rk = c + tl.arange(0, BK)
            ids = tl.load(idx_ptr + b * s_ib + t * s_it + rk, mask=rk < K, other=-1)
            ok = ids >= 0
            msk = ok[:, None] & (rd < D)[None, :]
            off = kbase + ids[:, None].to(tl.int64) * s_kt + rd[None, :]
            kk = tl.load(k_ptr + off, mask=msk, other=0.0).to(tl.float32)
            vv = tl.load(v_ptr + off, mask=msk, other=0.0).to(tl.float32)
            p = tl.where(ok, tl.exp(tl.sum(kk * q[None, :], 1) * scale - lse), 0.0)
            ds = p * (tl.sum(vv * do[None, :], 1) - delta)
            dq += tl.sum(ds[:, None] * kk, 0) * scale
            tl.atomic_add(dk_ptr + off, ds[:, None] * q[None, :] * scale, mask=msk)
            tl.atomic_add(dv_ptr + off, p[:, None] * do[None, :], mask=msk)
        tl.store(dq_ptr + qoff, dq, mask=rd < D)

    return topk_kernel, attn_fwd, attn_bwd


def indexer_topk(qi, w, ki, allowed, top_k: int) -> torch.Tensor:
    """`indexer_topk_reference` fused: scores, ReLU, head weights, mask and the running top-k in one pass over
    the keys, the [Lq, Lk] scores never stored. Triton where it runs; the reference elsewhere."""
    if not use_triton(qi):  # the reference by chunks of queries: [chunk, Lk] scores at a time
        lq, lk, chunk = qi.shape[1], ki.shape[1], 1024
        allowed = causal(lq, lk, qi.device).expand(qi.shape[0], -1, -1) if allowed is None else allowed
        return torch.cat([indexer_topk_reference(qi[:, c:c + chunk], w[:, c:c + chunk], ki, allowed[:, c:c + chunk],
                                                 top_k) for c in range(0, lq, chunk)], 1)
    import triton
    b, lq, hi, d = qi.shape
    lk = ki.shape[1]
    topk = max(16, triton.next_power_of_2(top_k))  # tl.topk wants a power of 2; the first top_k are the top_k
    idx = torch.empty(b, lq, topk, dtype=torch.int32, device=qi.device)
    qi, w, ki = qi.contiguous(), w.contiguous(), ki.contiguous()
    a = allowed.to(torch.int8).contiguous() if allowed is not None else idx
    bm = 16
    _kernels()[0][(b, triton.cdiv(lq, bm))](
        qi, w, ki, a, idx, lq, lk, d, hi, lk - lq, 1 / math.sqrt(d), qi.stride(0), qi.stride(1), qi.stride(2),
        w.stride(0), w.stride(1), ki.stride(0), ki.stride(1), a.stride(0), a.stride(1), idx.stride(0), idx.stride(1),
        HAS_MASK=allowed is not None, BM=bm, BD=max(16, triton.next_power_of_2(d)), TOPK=topk)
    return idx[..., :top_k].contiguous()


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx, scaling):
        import triton
        fwd = _kernels()[1]
        q, k, v, idx = q.contiguous(), k.contiguous(), v.contiguous(), idx.contiguous()
        b, h, lq, d = q.shape
        o = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        lse = torch.empty(b * h, lq, device=q.device, dtype=torch.float32)
        bd = max(16, triton.next_power_of_2(d))
        fwd[(b * h, lq)](q, k, v, idx, o, lse, h, h // k.shape[1], lq, d, idx.shape[-1], scaling,
                         q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                         idx.stride(0), idx.stride(1), BK=32, BD=bd)
        ctx.save_for_backward(q, k, v, idx, o, lse)
        ctx.scaling, ctx.bd = scaling, bd
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, idx, o, lse = ctx.saved_tensors
        b, h, lq, d = q.shape
        do = do.float().contiguous()
        delta = (do * o).sum(-1).view(b * h, lq).contiguous()
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        _kernels()[2][(b * h, lq)](q, k, v, idx, do, lse, delta, dq, dk, dv, h, h // k.shape[1], lq, d, idx.shape[-1],
                                   ctx.scaling, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                                   k.stride(2), idx.stride(0), idx.stride(1), BK=32, BD=ctx.bd)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def sparse_attention(q, k, v, idx, scaling: float) -> torch.Tensor:
    """Attention over the selected keys: the Triton kernels (forward and backward) where they run, the gathered
    torch form elsewhere. q [B, H, Lq, D], k and v [B, Hkv, Lk, D], idx [B, Lq, K]."""
    if use_triton(q):
        return _SparseAttention.apply(q, k, v, idx, scaling)
    return sparse_attention_gather(q, k, v, idx, scaling)
