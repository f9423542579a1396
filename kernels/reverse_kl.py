"""Full-vocabulary reverse KL(student || teacher) from the student's hidden states and output head, per token,
chunked like `kernels.logprob` (OPD's `loss: full`): the student's [tokens, vocab] logits, their softmax and
its gradient are never whole; only the teacher's log-probabilities, an input, are."""
from __future__ import annotations

import torch

from kernels import jit_cache, use_triton
from kernels.logprob import (default_chunk, head_forward, head_grads, pow2_block, row_warps, scaled_grads,
                             token_loss_grads)


def kl_chunk(n: int, vocab: int, dim: int) -> int:
    """Tokens per chunk: at least an eighth of them. The teacher's [N, vocab] fp32 input is already there, so such a
    chunk's logits add at most a sixteenth of it, and each chunk is one more pass over the [vocab, hidden] weight
    gradient (Liger's rule gives 128-token chunks at 4k tokens and vocab 152k: 32 passes, slower than torch)."""
    return min(n, max(default_chunk(n, vocab, dim), 1 << max(0, (-(-n // 8) - 1).bit_length())))


def linear_reverse_kl_reference(hidden: torch.Tensor, weight: torch.Tensor, teacher_logprobs: torch.Tensor,
                                temperature: float = 1.0) -> torch.Tensor:
    """sum_v p_s(v) (log p_s(v) - log p_t(v)) per row, p_s = softmax(hidden @ weight.T / temperature)."""
    ls = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1)
    return (ls.exp() * (ls - teacher_logprobs.float())).sum(-1)


@jit_cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stats(z_ptr, lt_ptr, lse_ptr, kl_ptr, V, stride, t_stride, inv_t, BLOCK: tl.constexpr):
        # KL = E_p[z - lt] - lse, with E_p accumulated online like the softmax's normaliser
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        t_base = lt_ptr + row.to(tl.int64) * t_stride
        m = -float("inf")
        s = 0.0
        acc = 0.0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < V
            z = tl.load(base + cols, mask=live, other=-float("inf")).to(tl.float32) * inv_t
            lt = tl.load(t_base + cols, mask=live, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, 0))
            e = tl.exp(z - m_new)
            scale = tl.exp(m - m_new)
            s = s * scale + tl.sum(e, 0)
            acc = acc * scale + tl.sum(e * tl.where(live, z - lt, 0.0), 0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        tl.store(kl_ptr + row, acc / s - lse)

    @triton.jit
    def grad(z_ptr, lt_ptr, lse_ptr, kl_ptr, g_ptr, V, stride, t_stride, inv_t, BLOCK: tl.constexpr):
        # d KL / dz = p (log p - lt - KL), times inv_t for the logits; in place
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        t_base = lt_ptr + row.to(tl.int64) * t_stride
        lse = tl.load(lse_ptr + row)
        kl = tl.load(kl_ptr + row)
        g = tl.load(g_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < V
            ls = tl.load(base + cols, mask=live, other=0.0).to(tl.float32) * inv_t - lse
            lt = tl.load(t_base + cols, mask=live, other=0.0).to(tl.float32)
            dz = g * tl.exp(ls) * (ls - lt - kl) * inv_t
            tl.store(base + cols, dz.to(z_ptr.dtype.element_ty), mask=live)

    return stats, grad


def _stats(z, lt, inv_t):
    n, v = z.shape
    if use_triton(z):
        lse, kl = (torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(2))
        _kernels()[0][(n,)](z, lt, lse, kl, v, z.stride(0), lt.stride(0), inv_t, BLOCK=pow2_block(v),
                             num_warps=row_warps())
        return kl, lse
    ls = torch.log_softmax(z.float() * inv_t, -1)
    return (ls.exp() * (ls - lt.float())).sum(-1), (z.float() * inv_t).logsumexp(-1)


def _grad_in_place(z, lt, lse, kl, g, inv_t):
    n, v = z.shape
    if use_triton(z):
        _kernels()[1][(n,)](z, lt, lse, kl, g, v, z.stride(0), lt.stride(0), inv_t, BLOCK=pow2_block(v),
                             num_warps=row_warps())
        return z
    ls = z.float() * inv_t - lse[:, None]
    return (g[:, None] * ls.exp() * (ls - lt.float() - kl[:, None]) * inv_t).to(z.dtype)


class _LinearReverseKL(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # the backward runs under the forward's autocast state
    def forward(ctx, hidden, weight, teacher, temperature, chunk):
        inv_t = 1.0 / temperature
        kl, lse = head_forward(hidden, weight, chunk, lambda z, rows: _stats(z, teacher[rows], inv_t))
        ctx.save_for_backward(hidden, weight, teacher, lse, kl)
        ctx.inv_t, ctx.chunk = inv_t, chunk
        return kl

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        hidden, weight, teacher, lse, kl = ctx.saved_tensors
        g = g.float().contiguous()
        d_hidden, d_weight = head_grads(
            hidden, weight, ctx.chunk, ctx.needs_input_grad[:2],
            lambda z, sl: _grad_in_place(z, teacher[sl], lse[sl], kl[sl], g[sl], ctx.inv_t))
        return d_hidden, d_weight, None, None, None


class _LinearReverseKLLoss(torch.autograd.Function):
    """The gradient in the forward (kernels.logprob's _LinearLogprobLoss, for the KL)."""
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, teacher, temperature, chunk, token_loss):
        inv_t = 1.0 / temperature
        losses, kls = [], []

        def dz_of(z, rows):
            kl, lse = _stats(z, teacher[rows], inv_t)
            kls.append(kl)
            loss, (g,) = token_loss_grads(token_loss, (kl,), rows)
            losses.append(loss)
            return _grad_in_place(z, teacher[rows], lse, kl, g, inv_t)

        needs = ctx.needs_input_grad[:2]
        d_hidden = d_weight = None
        if any(needs):
            d_hidden, d_weight = head_grads(hidden, weight, chunk, needs, dz_of)
        else:
            kls = list(head_forward(hidden, weight, chunk, lambda z, rows: _stats(z, teacher[rows], inv_t)[:1])[0]
                       .split(chunk))
            losses = [token_loss(kl, slice(a, a + chunk)).detach().float()
                      for a, kl in zip(range(0, hidden.size(0), chunk), kls)]
        ctx.save_for_backward(d_hidden, d_weight)
        kl = torch.cat(kls)
        ctx.mark_non_differentiable(kl)
        return torch.stack(losses).sum(), kl

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g_loss, _g_kl):
        return *scaled_grads(ctx.saved_tensors, g_loss), None, None, None, None


def linear_reverse_kl(hidden: torch.Tensor, weight: torch.Tensor, teacher_logprobs: torch.Tensor,
                      temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """`linear_reverse_kl_reference` (fp32, per row of `hidden` [N, D]) without the student's [N, vocab]
    logits; differentiable in `hidden` and `weight` (the teacher is a constant)."""
    if hidden.dim() != 2 or teacher_logprobs.shape != (hidden.size(0), weight.size(0)):
        raise ValueError(f"linear_reverse_kl: hidden must be [N, D] and teacher_logprobs [N, vocab={weight.size(0)}]; "
                         f"got {tuple(hidden.shape)} and {tuple(teacher_logprobs.shape)}")
    chunk = chunk_tokens or kl_chunk(hidden.size(0), weight.size(0), weight.size(1))
    return _LinearReverseKL.apply(hidden.contiguous(), weight, teacher_logprobs.contiguous(), float(temperature),
                                  chunk)


def linear_reverse_kl_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_logprobs: torch.Tensor, token_loss,
                           temperature: float = 1.0, chunk_tokens: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-token KL detached) with loss = sum over chunks of `token_loss(kl, rows)`: `linear_reverse_kl` with
    the gradient made in the forward (`kernels.logprob.linear_logprob_loss` says when that is exact)."""
    if hidden.dim() != 2 or teacher_logprobs.shape != (hidden.size(0), weight.size(0)):
        raise ValueError(f"linear_reverse_kl_loss: hidden must be [N, D] and teacher_logprobs [N, vocab="
                         f"{weight.size(0)}]; got {tuple(hidden.shape)} and {tuple(teacher_logprobs.shape)}")
    chunk = chunk_tokens or kl_chunk(hidden.size(0), weight.size(0), weight.size(1))
    return _LinearReverseKLLoss.apply(hidden.contiguous(), weight, teacher_logprobs.contiguous(), float(temperature),
                                      chunk, token_loss)
