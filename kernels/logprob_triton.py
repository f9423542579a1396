"""The row kernels of `kernels.logprob` (its interface, imported where triton may be absent: it imports this module on
first use): one program per row of a chunk's logits, the vocabulary in blocks."""
import triton
import triton.language as tl


@triton.jit
def row_stats(base, V, inv_t, BLOCK: tl.constexpr):
    """(log Z, entropy) of one row of logits: one pass over the vocabulary, online softmax."""
    m = -float("inf")
    s = 0.0
    t = 0.0  # sum of exp(z - m) * z, for the entropy
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        e = tl.exp(z - m_new)
        scale = tl.exp(m - m_new)
        s = s * scale + tl.sum(e, 0)
        t = t * scale + tl.sum(e * tl.where(cols < V, z, 0.0), 0)  # e is 0 off the end
        m = m_new
    lse = m + tl.log(s)
    return lse, lse - t / s


@triton.jit
def row_grad(base, tgt, lse, ent, g_lp, g_ent, V, inv_t, BLOCK: tl.constexpr):
    # d logp_t / dz = onehot(t) - p ; d H / dz = -p (log p + H); times inv_t for the logits; in place
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logp = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_t - lse
        dz = -tl.exp(logp) * (g_lp + g_ent * (logp + ent)) + tl.where(cols == tgt, g_lp, 0.0)
        tl.store(base + cols, (dz * inv_t).to(base.dtype.element_ty), mask=cols < V)


@triton.jit
def stats(z_ptr, target_ptr, lse_ptr, logp_ptr, ent_ptr, V, stride, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    lse, ent = row_stats(base, V, inv_t, BLOCK)
    tgt = tl.load(target_ptr + row)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.load(base + tgt).to(tl.float32) * inv_t - lse)
    tl.store(ent_ptr + row, ent)


@triton.jit
def grad(z_ptr, target_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, V, stride, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_grad(z_ptr + row.to(tl.int64) * stride, tl.load(target_ptr + row), tl.load(lse_ptr + row),
             tl.load(ent_ptr + row), tl.load(g_lp_ptr + row), tl.load(g_ent_ptr + row), V, inv_t, BLOCK)


@triton.jit
def stats_grad(z_ptr, target_ptr, g_lp_ptr, g_ent_ptr, logp_ptr, ent_ptr, V, stride, inv_t,
               BLOCK: tl.constexpr):
    # a loss linear in (logp, entropy) with known coefficients: both passes in one program (Liger's kernel)
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    lse, ent = row_stats(base, V, inv_t, BLOCK)
    tgt = tl.load(target_ptr + row)
    tl.store(logp_ptr + row, tl.load(base + tgt).to(tl.float32) * inv_t - lse)
    tl.store(ent_ptr + row, ent)
    row_grad(base, tgt, lse, ent, tl.load(g_lp_ptr + row), tl.load(g_ent_ptr + row), V, inv_t, BLOCK)
