"""Fused output head -> log-probability of the target token and entropy, forward and backward.

At vocab 152k, 16k tokens of fp32 logits are 10 GB, and log_softmax, its exp and their gradients each make
another copy. Here the tokens go through the head in chunks of `chunk_tokens` (sized so a chunk's logits are
about the size of the hidden states); per chunk, one pass over the vocabulary (in blocks, online softmax)
gives log Z, the target's log-probability and the entropy, and a second turns the logits into their gradient in
place, which multiplies back into the hidden states and the head. Two orders:

- `linear_logprob_loss`: the loss is a sum of per-token terms given as a function, so each chunk's upstream
  gradient is known as soon as its log-probabilities are: the gradient is made in the forward, as Liger-Kernel's
  fused cross-entropy does, and the logits are computed once.
- `linear_logprob`: (log-probability, entropy) for a loss of any shape; its upstream gradient arrives in the
  backward, which recomputes each chunk's logits (one more head matmul).
"""
from __future__ import annotations

import math

import torch

from kernels import interpreting, jit_cache, use_triton

BLOCK_V = 1024
# a row kernel's vocabulary block and warps on a GPU: what bench/kernels' sweep picked on an H100 in four runs
# of four (Liger's 32k and 32 warps, 8k and 16k were within 7% of it)
ROW_LAUNCH = {"BLOCK": 4096, "num_warps": 8}


def linear_logprob_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per row of `hidden` [N, D] under logits `hidden @ weight.T / temperature`."""
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1)
    return logp_all.gather(-1, target[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def default_chunk(n: int, vocab: int, dim: int) -> int:
    """Tokens per chunk: a chunk's logits about the size of all hidden states (Liger's rule), a power of 2."""
    return max(1, min(n, 2 ** math.ceil(math.log2(max(1, math.ceil(n / math.ceil(vocab / dim)))))))


@jit_cache
def _kernels():
    from kernels import logprob_triton
    return logprob_triton.stats, logprob_triton.grad, logprob_triton.stats_grad


def _stats(z: torch.Tensor, target: torch.Tensor, inv_t: float):
    n, v = z.shape
    if use_triton(z):
        lse, logp, ent = (torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(3))
        _kernels()[0][(n,)](z, target, lse, logp, ent, v, z.stride(0), inv_t, BLOCK=pow2_block(v),
                             num_warps=row_warps())
        return logp, ent, lse
    zf = z.float() * inv_t
    lse = zf.logsumexp(-1)
    logp = zf.gather(-1, target[:, None]).squeeze(-1) - lse
    return logp, lse - (torch.softmax(zf, -1) * zf).sum(-1), lse


def _grad_in_place(z: torch.Tensor, target: torch.Tensor, lse, ent, g_lp, g_ent, inv_t: float) -> torch.Tensor:
    n, v = z.shape
    if use_triton(z):
        _kernels()[1][(n,)](z, target, lse, ent, g_lp, g_ent, v, z.stride(0), inv_t, BLOCK=pow2_block(v),
                             num_warps=row_warps())
        return z
    logp = z.float() * inv_t - lse[:, None]
    dz = -logp.exp() * (g_lp[:, None] + g_ent[:, None] * (logp + ent[:, None]))
    dz[torch.arange(n, device=z.device), target] += g_lp
    return dz.mul_(inv_t).to(z.dtype)


def _stats_and_grad(z: torch.Tensor, target: torch.Tensor, g_lp, g_ent, inv_t: float):
    """(logp, entropy, the logits' gradient in place of `z`) for upstream gradients known before the logits are."""
    n, v = z.shape
    if use_triton(z):
        logp, ent = (torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(2))
        _kernels()[2][(n,)](z, target, g_lp, g_ent, logp, ent, v, z.stride(0), inv_t, BLOCK=pow2_block(v),
                             num_warps=row_warps())
        return logp, ent, z
    logp, ent, lse = _stats(z, target, inv_t)
    return logp, ent, _grad_in_place(z, target, lse, ent, g_lp, g_ent, inv_t)


def pow2_block(v: int) -> int:
    """The vocabulary block of a row kernel: a power of 2, at least 16, at most ROW_LAUNCH's block on a GPU
    (BLOCK_V under the interpreter, where a ragged last block is what the tests need to see)."""
    top = BLOCK_V if interpreting() else ROW_LAUNCH["BLOCK"]
    return min(top, 1 << max(4, (v - 1).bit_length()))


def row_warps() -> int:
    return 4 if interpreting() else ROW_LAUNCH["num_warps"]


def _add_weight_grad(d_weight: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """d_weight += dz.T @ h: in place in the matmul's epilogue where the dtypes agree (bf16 weights accumulate in
    bf16, as Liger's default does: no [vocab, hidden] fp32 copy); fp32 weights under bf16 autocast (the pipeline's
    fp32 master weights) add a bf16 product into the fp32 sum."""
    if d_weight.dtype == dz.dtype == h.dtype:
        d_weight.addmm_(dz.t(), h)
    else:
        d_weight += dz.t() @ h


def head_forward(hidden: torch.Tensor, weight: torch.Tensor, chunk: int, stats_of) -> tuple[torch.Tensor, ...]:
    """`stats_of(logits, rows)` per chunk of tokens, its per-row outputs concatenated; each chunk's logits are
    dropped before the next one's exist."""
    outs = [stats_of(hidden[a:a + chunk] @ weight.t(), slice(a, a + chunk)) for a in range(0, hidden.size(0), chunk)]
    return tuple(torch.cat(x) for x in zip(*outs))


def head_grads(hidden: torch.Tensor, weight: torch.Tensor, chunk: int, needs: tuple[bool, bool], dz_of):
    """Gradients of `hidden` and `weight` from a chunk's logits gradient `dz_of(logits, rows)` (which may record
    what it computes on the way), chunk by chunk, a chunk's logits dropped before the next one's exist."""
    d_hidden = torch.empty_like(hidden) if needs[0] else None
    d_weight = torch.zeros_like(weight) if needs[1] else None
    for a in range(0, hidden.size(0), chunk):
        h, rows = hidden[a:a + chunk], slice(a, a + chunk)
        dz = dz_of(h @ weight.t(), rows)
        if d_hidden is not None:
            if dz.dtype == weight.dtype == d_hidden.dtype:
                torch.mm(dz, weight, out=d_hidden[rows])
            else:
                d_hidden[rows] = dz @ weight
        if d_weight is not None:
            _add_weight_grad(d_weight, dz, h)
        del dz  # before the next chunk's logits exist: one chunk's at a time (H100: 297 MB at the peak, 149 without)
    return d_hidden, d_weight


def token_loss_grads(token_loss, values: tuple[torch.Tensor, ...], rows: slice) -> tuple[torch.Tensor, list]:
    """(the loss of these rows, d loss / d each of `values`): `token_loss(*values, rows)` differentiated on its own
    rows, which is exact where the loss is a sum of per-token terms (a mean over a count known beforehand is one)."""
    leaves = [v.detach().requires_grad_() for v in values]
    with torch.enable_grad():
        loss = token_loss(*leaves, rows)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    return loss.detach().float(), [torch.zeros_like(v) if g is None else g.float().contiguous()
                                   for v, g in zip(values, grads)]


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # the backward runs under the forward's autocast state
    def forward(ctx, hidden, weight, target, temperature, chunk):
        inv_t = 1.0 / temperature
        logp, ent, lse = head_forward(hidden, weight, chunk, lambda z, rows: _stats(z, target[rows], inv_t))
        ctx.save_for_backward(hidden, weight, target, lse, ent)
        ctx.inv_t, ctx.chunk = inv_t, chunk
        return logp, ent

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g_lp, g_ent):
        hidden, weight, target, lse, ent = ctx.saved_tensors
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        d_hidden, d_weight = head_grads(
            hidden, weight, ctx.chunk, ctx.needs_input_grad[:2],
            lambda z, sl: _grad_in_place(z, target[sl], lse[sl], ent[sl], g_lp[sl], g_ent[sl], ctx.inv_t))
        return d_hidden, d_weight, None, None, None


class _LinearLogprobLoss(torch.autograd.Function):
    """Liger's order: the gradient in the forward, the logits made once; the backward scales it. `token_loss` is a
    function of each chunk's (logp, entropy, rows), or the coefficients (of logp, of entropy) of a loss linear in
    them: each chunk then takes one row kernel (both passes, as Liger's) and no torch op between two."""
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, target, temperature, chunk, token_loss, value_of):
        inv_t = 1.0 / temperature
        losses, logps, ents = [], [], []
        linear = isinstance(token_loss, tuple)
        if linear:
            c_lp, c_ent = token_loss
            value_of = lambda lp, en: (c_lp * lp).sum() + (c_ent * en).sum()  # noqa: E731

        def stats(z, rows):
            logp, ent, lse = _stats(z, target[rows], inv_t)
            logps.append(logp)
            ents.append(ent)
            return logp, ent, lse

        def dz_of(z, rows):
            if linear:
                logp, ent, dz = _stats_and_grad(z, target[rows], c_lp[rows], c_ent[rows], inv_t)
                logps.append(logp)
                ents.append(ent)
                return dz
            logp, ent, lse = stats(z, rows)
            loss, (g_lp, g_ent) = token_loss_grads(token_loss, (logp, ent), rows)
            losses.append(loss)
            return _grad_in_place(z, target[rows], lse, ent, g_lp, g_ent, inv_t)

        needs = ctx.needs_input_grad[:2]
        d_hidden = d_weight = None
        if any(needs):
            d_hidden, d_weight = head_grads(hidden, weight, chunk, needs, dz_of)
        else:  # no gradient wanted (evaluation): the statistics and the loss alone
            head_forward(hidden, weight, chunk, lambda z, rows: stats(z, rows)[:1])
            if not linear:
                losses = [token_loss(lp, en, slice(a, a + chunk)).detach().float()
                          for a, lp, en in zip(range(0, hidden.size(0), chunk), logps, ents)]
        ctx.save_for_backward(d_hidden, d_weight)
        logp, ent = torch.cat(logps), torch.cat(ents)
        ctx.mark_non_differentiable(logp, ent)  # the gradient went into the loss's
        total = torch.stack(losses).sum() if value_of is None else value_of(logp, ent).detach().float()
        return total, logp, ent

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g_loss, _g_lp, _g_ent):
        return *scaled_grads(ctx.saved_tensors, g_loss), None, None, None, None, None


def scaled_grads(grads, g_loss: torch.Tensor) -> list:
    """The gradients made in the forward, times the loss's upstream gradient where that is not 1 (a loss scaled
    after the fact: gradient accumulation, a weighted term), in place."""
    if torch.equal(g_loss, torch.ones_like(g_loss)):
        return list(grads)
    return [None if d is None else d.mul_(g_loss.to(d.dtype)) for d in grads]


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_logprob_reference`'s (log p(target), entropy), both fp32, without the [N, vocab] logits;
    differentiable in `hidden` and `weight`. `hidden` is [N, D] (flatten the batch first)."""
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprob: hidden must be [N, D] and target [N]; got {tuple(hidden.shape)} and "
                         f"{tuple(target.shape)}")
    chunk = chunk_tokens or default_chunk(hidden.size(0), weight.size(0), weight.size(1))
    return _LinearLogprob.apply(hidden.contiguous(), weight, target.contiguous(), float(temperature), chunk)


def linear_weighted_logprob_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 logp_weights: torch.Tensor, entropy_weights: torch.Tensor | None = None,
                                 temperature: float = 1.0, chunk_tokens: int | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_logprob_loss` of the loss sum(logp_weights * logp + entropy_weights * entropy), per-token weights [N]
    (an SFT mean NLL: -mask / count): the coefficients known beforehand, each chunk's statistics and logits gradient
    come from one row kernel, as Liger's cross-entropy does, without `token_loss`'s autograd between two kernels."""
    n = hidden.size(0)
    if logp_weights.shape != (n,) or (entropy_weights is not None and entropy_weights.shape != (n,)):
        raise ValueError(f"linear_weighted_logprob_loss: the weights must be [N] = [{n}]; got "
                         f"{tuple(logp_weights.shape)} and "
                         f"{None if entropy_weights is None else tuple(entropy_weights.shape)}")
    c_lp = logp_weights.detach().float().contiguous()
    c_ent = torch.zeros_like(c_lp) if entropy_weights is None else entropy_weights.detach().float().contiguous()
    return linear_logprob_loss(hidden, weight, target, (c_lp, c_ent), temperature, chunk_tokens)


def linear_logprob_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, token_loss,
                        temperature: float = 1.0, chunk_tokens: int | None = None, value_of=None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, log p(target), entropy) where loss = sum over chunks of `token_loss(logp, entropy, rows)`, `rows` the
    chunk's slice of the N tokens; differentiable in `hidden` and `weight` through the loss only (the log-probabilities
    and entropies come back detached, for logging). `value_of(logp, entropy)` of all N tokens, where given, is the
    loss's value instead of the chunks' sum (for a `token_loss` whose chunk values mean nothing on their own).

    For a loss that is a sum of per-token terms (an SFT mean NLL over a known count of tokens, a per-token clipped
    policy loss with its advantages and old log-probabilities indexed by `rows`): the backward is certain, so the
    gradient is made in the forward, as Liger-Kernel does, and the chunk's logits are computed once instead of twice.
    A loss that couples tokens (a sequence-level ratio) needs `linear_logprob`."""
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprob_loss: hidden must be [N, D] and target [N]; got {tuple(hidden.shape)} and "
                         f"{tuple(target.shape)}")
    chunk = chunk_tokens or default_chunk(hidden.size(0), weight.size(0), weight.size(1))
    return _LinearLogprobLoss.apply(hidden.contiguous(), weight, target.contiguous(), float(temperature), chunk,
                                    token_loss, value_of)
