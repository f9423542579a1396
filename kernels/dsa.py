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
    def scores_kernel(qi_ptr, w_ptr, ki_ptr, a_ptr, out_ptr, LQ, LK, D, HI, OFFSET, scale,
                      s_qb, s_qt, s_qh, s_wb, s_wt, s_kb, s_kt, s_ab, s_at, s_ob, s_ot,
                      HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
        # one [BM queries, BN keys] tile of index scores: every head's dot on the tensor cores, ReLU, weighted sum;
        # -inf where the mask forbids. Tiles wholly above the causal diagonal skip the dots.
        n0, m0, b = tl.program_id(0) * BN, tl.program_id(1) * BM, tl.program_id(2)
        rm, rn, rd = m0 + tl.arange(0, BM), n0 + tl.arange(0, BN), tl.arange(0, BD)
        s = tl.zeros([BM, BN], dtype=tl.float32)
        last = LK if HAS_MASK else m0 + BM - 1 + OFFSET  # the last key any query of the tile may see
        if n0 <= last:
            kk = tl.load(ki_ptr + b * s_kb + rn[:, None].to(tl.int64) * s_kt + rd[None, :],
                         mask=(rn < LK)[:, None] & (rd < D)[None, :], other=0.0)
            for h in range(0, HI):
                q = tl.load(qi_ptr + b * s_qb + rm[:, None].to(tl.int64) * s_qt + h * s_qh + rd[None, :],
                            mask=(rm < LQ)[:, None] & (rd < D)[None, :], other=0.0)
                wh = tl.load(w_ptr + b * s_wb + rm.to(tl.int64) * s_wt + h, mask=rm < LQ, other=0.0).to(tl.float32)
                s += wh[:, None] * tl.maximum(tl.dot(q, tl.trans(kk)), 0.0)
        ok = (rm < LQ)[:, None] & (rn < LK)[None, :]
        if HAS_MASK:
            ok &= tl.load(a_ptr + b * s_ab + rm[:, None].to(tl.int64) * s_at + rn[None, :], mask=ok, other=0) != 0
        else:
            ok &= rn[None, :] <= rm[:, None] + OFFSET
        tl.store(out_ptr + b * s_ob + rm[:, None].to(tl.int64) * s_ot + rn[None, :],
                 tl.where(ok, s * scale, -float("inf")), mask=(rm < LQ)[:, None] & (rn < LK)[None, :])

    @triton.jit
    def attn_fwd(q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr, H, HKV, G, LQ, D, K, scale,
                 s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_ib, s_it,
                 GP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
        # one program per (query, batch x key head): the G query heads sharing the key head share the selection,
        # so each selected key is loaded once for all of them and the dots run on the tensor cores; online softmax
        # over BK keys at a time. Queries on the grid's first axis: the second allows at most 65535.
        t, bk = tl.program_id(0), tl.program_id(1)
        b, hk = bk // HKV, bk % HKV
        rg, rd = tl.arange(0, GP), tl.arange(0, BD)
        heads = hk * G + rg
        qmask = (rg < G)[:, None] & (rd < D)[None, :]
        qoff = b * s_qb + heads[:, None] * s_qh + t * s_qt + rd[None, :]
        q = tl.load(q_ptr + qoff, mask=qmask, other=0.0)
        kbase = b * s_kb + hk * s_kh
        m = tl.full([GP], -float("inf"), tl.float32)
        l = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, BD], dtype=tl.float32)
        for c in range(0, K, BK):
            rk = c + tl.arange(0, BK)
            ids = tl.load(idx_ptr + b * s_ib + t * s_it + rk, mask=rk < K, other=-1)
            ok = ids >= 0
            off = kbase + ids[:, None].to(tl.int64) * s_kt + rd[None, :]
            kk = tl.load(k_ptr + off, mask=ok[:, None] & (rd < D)[None, :], other=0.0)
            vv = tl.load(v_ptr + off, mask=ok[:, None] & (rd < D)[None, :], other=0.0)
            s = tl.where(ok[None, :], tl.dot(q, tl.trans(kk)) * scale, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp(s - safe[:, None])
            alpha = tl.exp(m - safe)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
            m = m_new
        o = tl.where(l[:, None] > 0, acc / l[:, None], 0.0)
        tl.store(o_ptr + qoff, o, mask=qmask)
        tl.store(lse_ptr + (b * H + heads) * LQ + t, tl.where(l > 0, m + tl.log(l), float("inf")), mask=rg < G)

    @triton.jit
    def attn_bwd(q_ptr, k_ptr, v_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, H, HKV, G, LQ, D,
                 K, scale, s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_ib, s_it,
                 GP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
        # the forward's layout; p recomputed from the saved log-sum-exp; dq in registers, dk and dv scattered
        # with atomics (a key is selected by many queries), once per key head rather than per query head. A
        # key-major pass (no atomics, not tried) would read every selecting query's q and do for its G heads per
        # key: 4 KB a pair at G 8, D 128 in bf16, where these atomics add 1 KB (dk and dv in fp32)
        t, bk = tl.program_id(0), tl.program_id(1)
        b, hk = bk // HKV, bk % HKV
        rg, rd = tl.arange(0, GP), tl.arange(0, BD)
        heads = hk * G + rg
        qmask = (rg < G)[:, None] & (rd < D)[None, :]
        qoff = b * s_qb + heads[:, None] * s_qh + t * s_qt + rd[None, :]
        q = tl.load(q_ptr + qoff, mask=qmask, other=0.0)
        do = tl.load(do_ptr + qoff, mask=qmask, other=0.0)
        lse = tl.load(lse_ptr + (b * H + heads) * LQ + t, mask=rg < G, other=float("inf"))
        delta = tl.load(delta_ptr + (b * H + heads) * LQ + t, mask=rg < G, other=0.0)
        kbase = b * s_kb + hk * s_kh
        dq = tl.zeros([GP, BD], dtype=tl.float32)
        for c in range(0, K, BK):
            rk = c + tl.arange(0, BK)
            ids = tl.load(idx_ptr + b * s_ib + t * s_it + rk, mask=rk < K, other=-1)
            ok = ids >= 0
            msk = ok[:, None] & (rd < D)[None, :]
            off = kbase + ids[:, None].to(tl.int64) * s_kt + rd[None, :]
            kk = tl.load(k_ptr + off, mask=msk, other=0.0)
            vv = tl.load(v_ptr + off, mask=msk, other=0.0)
            p = tl.where(ok[None, :], tl.exp(tl.dot(q, tl.trans(kk)) * scale - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(vv)) - delta[:, None])
            dq += tl.dot(ds.to(kk.dtype), kk) * scale
            tl.atomic_add(dk_ptr + off, tl.dot(tl.trans(ds).to(q.dtype), q) * scale, mask=msk, sem="relaxed")
            tl.atomic_add(dv_ptr + off, tl.dot(tl.trans(p).to(do.dtype), do), mask=msk, sem="relaxed")
        tl.store(dq_ptr + qoff, dq, mask=qmask)

    return scores_kernel, attn_fwd, attn_bwd


def indexer_topk(qi, w, ki, allowed, top_k: int, chunk_bytes: int = 2 ** 29) -> torch.Tensor:
    """`indexer_topk_reference` for long sequences: by chunks of queries, the [chunk, Lk] scores (ReLU, head
    weights and mask fused in one Triton kernel where it runs), then torch.topk per row, as DeepSeek's own
    inference code selects (a top-k merged per key block inside the kernel kept [rows, 2 * top_k] in registers:
    at top_k 2048 it did not finish compiling). Equal scores may go to either key on a GPU (torch.topk's order)."""
    b, lq, _, d = qi.shape
    lk = ki.shape[1]
    chunk = max(16, min(lq, chunk_bytes // (4 * b * lk)))
    if not use_triton(qi):
        allowed = causal(lq, lk, qi.device).expand(b, -1, -1) if allowed is None else allowed
        return torch.cat([indexer_topk_reference(qi[:, c:c + chunk], w[:, c:c + chunk], ki, allowed[:, c:c + chunk],
                                                 top_k) for c in range(0, lq, chunk)], 1)
    import triton
    scores_kernel = _kernels()[0]
    qi, w, ki = qi.contiguous(), w.contiguous(), ki.to(qi.dtype).contiguous()  # tl.dot wants one dtype
    a = allowed.to(torch.int8).contiguous() if allowed is not None else None
    out = torch.full((b, lq, top_k), -1, dtype=torch.int32, device=qi.device)
    bm, bn = 64, 64
    for c in range(0, lq, chunk):
        n = min(chunk, lq - c)
        # causal: the chunk's last query sees keys up to lk - lq + c + n - 1; the keys past it are neither
        # scored nor ranked (half the work over a whole sequence)
        width = lk if a is not None else min(lk, lk - lq + c + n)
        sc = torch.empty(b, n, width, dtype=torch.float32, device=qi.device)
        qc, wc = qi[:, c:c + n], w[:, c:c + n]
        ac = a[:, c:c + n] if a is not None else sc
        scores_kernel[(triton.cdiv(width, bn), triton.cdiv(n, bm), b)](
            qc, wc, ki, ac, sc, n, width, d, qi.shape[2], lk - lq + c, 1 / math.sqrt(d), qc.stride(0), qc.stride(1),
            qc.stride(2), wc.stride(0), wc.stride(1), ki.stride(0), ki.stride(1), ac.stride(0), ac.stride(1),
            sc.stride(0), sc.stride(1), HAS_MASK=a is not None, BM=bm, BN=bn, BD=max(16, triton.next_power_of_2(d)))
        vals, ids = sc.topk(min(top_k, width), dim=-1)
        out[:, c:c + n, :ids.shape[-1]] = ids.int().masked_fill(vals == float("-inf"), -1)
    return out


# keys per step and launch settings, the fastest of a sweep on an H100 (32 heads over 4 key heads of 128, top 2048,
# 32k tokens, bf16): forward 19.6 ms against 24.4 ms at 32 keys. The backward is bound by its atomics: relaxed ones
# (no ordering is needed between adds) took forward + backward at 128k from 1,328 to 880 ms, and 32 keys a step
# with 4 warps from there to 803 (65k: 609 -> 379 -> 302 ms; BK 16-64, 2-8 warps, 2-3 stages swept)
FWD_LAUNCH = dict(BK=64, num_warps=4, num_stages=2)
BWD_LAUNCH = dict(BK=32, num_warps=4, num_stages=2)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx, scaling):
        import triton
        q, k, v, idx = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(), idx.contiguous()
        b, h, lq, d = q.shape
        hkv = k.shape[1]
        o = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # bf16 on a GPU, as flash keeps it
        lse = torch.empty(b * h, lq, device=q.device, dtype=torch.float32)
        ctx.blocks = dict(GP=max(16, triton.next_power_of_2(h // hkv)), BD=max(16, triton.next_power_of_2(d)))
        _kernels()[1][(lq, b * hkv)](q, k, v, idx, o, lse, h, hkv, h // hkv, lq, d, idx.shape[-1], scaling,
                                     q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                     idx.stride(0), idx.stride(1), **ctx.blocks, **FWD_LAUNCH)
        ctx.save_for_backward(q, k, v, idx, o, lse)
        ctx.scaling = scaling
        return o  # saved for the backward too (autograd checks it is not modified in place)

    @staticmethod
    def backward(ctx, do):
        q, k, v, idx, o, lse = ctx.saved_tensors
        b, h, lq, d = q.shape
        hkv = k.shape[1]
        delta = (do.float() * o.float()).sum(-1).view(b * h, lq).contiguous()
        do = do.to(q.dtype).contiguous()
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        _kernels()[2][(lq, b * hkv)](q, k, v, idx, do, lse, delta, dq, dk, dv, h, hkv, h // hkv, lq, d, idx.shape[-1],
                                     ctx.scaling, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                                     k.stride(2), idx.stride(0), idx.stride(1), **ctx.blocks, **BWD_LAUNCH)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def sparse_attention(q, k, v, idx, scaling: float) -> torch.Tensor:
    """Attention over the selected keys: the Triton kernels (forward and backward) where they run, the gathered
    torch form elsewhere. q [B, H, Lq, D], k and v [B, Hkv, Lk, D], idx [B, Lq, K]."""
    if use_triton(q):
        return _SparseAttention.apply(q, k, v, idx, scaling)
    return sparse_attention_gather(q, k, v, idx, scaling)
