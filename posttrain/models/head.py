"""Token log-probabilities, entropies and reverse KL of a causal LM, through its full logits or through the fused
head kernels (`kernels.logprob`, `kernels.reverse_kl`), which never build the [tokens, vocab] logits.

The fused path takes the model's last hidden state (`output_hidden_states`, with `logits_to_keep=1` so the
model's own head runs on one position only) and the output embeddings; it is used where it pays, on CUDA
and at vocabularies of 32k and more, and is checked once per model: the kept position's logits must equal
hidden @ W.T, so a head with a bias, a soft-cap or a scale fails loudly instead of training the wrong thing.
`POSTTRAIN_FUSED_LOGPROB=1` / `=0` forces it on or off (benchmarks, tests)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.logprob import linear_logprob, linear_logprob_loss, linear_weighted_logprob_loss
from kernels.reverse_kl import linear_reverse_kl_loss
from posttrain.models.logits import SCALING, scaling
from posttrain.models.prefix import pad_rows, prefix_forward

FUSED_MIN_VOCAB = 32768
ENV = "POSTTRAIN_FUSED_LOGPROB"
_SCALING = SCALING  # the name posttrain.checkpoint_rules reads


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP


def fused(model: torch.nn.Module) -> bool:
    """Whether `model`'s token scores go through the fused head kernels."""
    forced = os.environ.get(ENV, "")
    m = unwrap(model)
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return False
    if forced in ("0", "1"):
        return forced == "1"
    return head.weight.is_cuda or head.out_features >= FUSED_MIN_VOCAB


def _head_weight(model, out) -> torch.Tensor:
    """The output embeddings, after checking once that the model's logits are hidden @ W.T."""
    m = unwrap(model)
    head = m.get_output_embeddings()
    if not getattr(m, "_posttrain_head_checked", False):
        scaled = scaling(m.config)
        with torch.no_grad():
            got = out.hidden_states[-1][:, -1] @ head.weight.t()
            want = out.logits[:, -1].to(got.dtype)
            tol = 1e-3 if got.dtype == torch.float32 else 3e-2  # bf16 matmuls may round differently
            off = (got - want).abs().max().item() > tol * max(1.0, want.abs().max().item())
        if head.bias is not None or scaled or off:
            raise ValueError(f"{type(m).__name__}: the logits are not the last hidden state times the output "
                             f"embeddings (bias={head.bias is not None}, scaling={scaled}, mismatch={off}), so the "
                             f"fused log-probability kernels would compute something else; set {ENV}=0")
        m._posttrain_head_checked = True
    return head.weight


def _nothing_scored(model, fused_path: bool, input_ids: torch.Tensor, inputs: dict) -> torch.Tensor:
    """`sequence_logprobs` of a batch with no scored position (rows of prompt only, an empty row): an empty tensor
    (float32 on the fused path, else the parameters' dtype), the model not run. Under autograd it is a leaf of its
    own, so a loss summed over it is 0 and backpropagates nothing: the parameters' gradients stay as they were and
    AdamW skips those that have none. Two callers need the forward itself, and get it on one kept position, the
    result then an empty slice of its logits: DDP (every rank must join the gradient all-reduce; this one adds
    zeros) and a model whose MTP layer is capturing this forward's hidden states for its loss (posttrain.models.mtp)."""
    m = unwrap(model)
    params = next(m.parameters(), None)
    dev = params.device if params is not None else input_ids.device
    dtype = torch.float32 if fused_path or params is None or not params.is_floating_point() else params.dtype
    ddp = torch.is_grad_enabled() and isinstance(model, torch.nn.parallel.DistributedDataParallel)
    mtp = getattr(m, "mtp", None)
    capturing = bool(getattr(mtp, "capture", False))
    if capturing and input_ids.shape[-1] == 0:  # nothing to run on: what the MTP loss reads, empty
        mtp.seen.update(hidden=torch.zeros(input_ids.shape[0], 0, m.config.hidden_size, device=dev,
                                           dtype=params.dtype), position_ids=None, mask=None)
        capturing = False
    if not (ddp or capturing):
        return torch.zeros(0, device=dev, dtype=dtype, requires_grad=torch.is_grad_enabled())
    if input_ids.shape[-1] == 0:  # DDP, no token at all: one stand-in token, its other inputs dropped
        input_ids = input_ids.new_zeros((1, 1))
        inputs = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    logits = model(input_ids=input_ids, **inputs, logits_to_keep=1).logits
    return logits.reshape(-1)[:0].to(dtype)


def sequence_logprobs(model, input_ids: torch.Tensor, targets_mask: torch.Tensor, **inputs) -> torch.Tensor:
    """log p(input_ids[:, t+1] | ...) at the positions where `targets_mask[:, t+1]` is non-zero, flattened in
    row-major order (the masked_lm_loss layout); other positions cost nothing on the fused path. A batch with no
    such position (prompt-only or empty rows) returns an empty tensor without running the model, on every path
    (except where the forward itself is needed: DDP, an MTP capture; `_nothing_scored`)."""
    target, sel = input_ids[:, 1:], targets_mask[:, 1:] != 0
    # no cache to fill: and transformers reads packed documents from restarting positions only without one
    # (GLM-5's masks: with a cache the documents of a packed row attended to each other, 0.17 in logits)
    inputs.setdefault("use_cache", False)
    use_fused = fused(model)
    if not bool(sel.any()):
        return _nothing_scored(model, use_fused, input_ids, inputs)
    if use_fused:
        out = model(input_ids=input_ids, **inputs, output_hidden_states=True, logits_to_keep=1)
        return linear_logprob(out.hidden_states[-1][:, :-1][sel], _head_weight(model, out), target[sel])[0]
    if input_ids.shape[0] == 1:  # one row (padding-free batches): the head runs on the scored positions only
        keep = sel[0].nonzero()[:, 0]
        logits = model(input_ids=input_ids, **inputs, logits_to_keep=keep).logits[0]
        return -F.cross_entropy(logits, target[sel], reduction="none")
    logits = model(input_ids=input_ids, **inputs).logits[:, :-1]
    return -F.cross_entropy(logits[sel], target[sel], reduction="none")


def sequence_nll(model, input_ids: torch.Tensor, targets_mask: torch.Tensor, weights: torch.Tensor,
                 **inputs) -> torch.Tensor:
    """-sum(weights * logp), `logp` being `sequence_logprobs`' log-probabilities and `weights` one per scored token in
    that flat layout (an NLL mean over a known count: mask / count). On the fused path the gradient is made in the
    forward (`kernels.logprob.linear_weighted_logprob_loss`, Liger's order: the chunk's logits once, not recomputed in
    the backward, and one row kernel a chunk); elsewhere the same sum over the full logits' log-probabilities."""
    target, sel = input_ids[:, 1:], targets_mask[:, 1:] != 0
    inputs.setdefault("use_cache", False)
    if not fused(model) or not bool(sel.any()):
        return -(sequence_logprobs(model, input_ids, targets_mask, **inputs) * weights).sum()
    out = model(input_ids=input_ids, **inputs, output_hidden_states=True, logits_to_keep=1)
    return linear_weighted_logprob_loss(out.hidden_states[-1][:, :-1][sel], _head_weight(model, out), target[sel],
                                        -weights)[0]


def completion_scores(model, samples: list, pad_id: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, entropy) [samples, longest completion] of each completion token at `temperature`
    (0 past a completion's end), in posttrain.models.prefix's completion layout."""
    dev = next(model.parameters()).device
    ids = pad_rows([s.ids for s in samples], 0, device=dev)
    real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, dev)
    if not fused(model):
        logp_all = torch.log_softmax(prefix_forward(model, samples, pad_id).float() / temperature, -1)
        logp, ent = logp_all.gather(-1, ids[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
        return logp.masked_fill(~real, 0.0), ent.masked_fill(~real, 0.0)
    hidden, out = prefix_forward(model, samples, pad_id, "hidden")
    logp, ent = linear_logprob(hidden[real], _head_weight(model, out), ids[real], temperature)
    return logp.new_zeros(ids.shape).masked_scatter(real, logp), ent.new_zeros(ids.shape).masked_scatter(real, ent)


def completion_loss(model, samples: list, pad_id: int, temperature: float, loss_of
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_of(logp, ent), logp, ent), `completion_scores`' [samples, longest] log-probabilities and entropies (0
    past a completion's end) handed to `loss_of` and returned detached. `loss_of` must be a sum of per-token terms
    (a token's gradient depending on that token's values alone: the RL policy losses, an entropy bonus, a k3 KL to
    a reference known beforehand): on the fused path it is differentiated chunk by chunk with the gradient made in
    the forward (`kernels.logprob.linear_logprob_loss`), the tokens outside the chunk zero (their terms may be
    anything, inf included: only the chunk's own reach its gradient), and the value returned is `loss_of` of all
    the tokens."""
    if not fused(model):
        logp, ent = completion_scores(model, samples, pad_id, temperature)
        return loss_of(logp, ent), logp.detach(), ent.detach()
    dev = next(model.parameters()).device
    ids = pad_rows([s.ids for s in samples], 0, device=dev)
    real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, dev)
    where = real.flatten().nonzero()[:, 0]  # flat position of each scored token

    def padded(values: torch.Tensor, rows: slice) -> torch.Tensor:
        return values.new_zeros(real.numel()).index_put((where[rows],), values).view(real.shape)

    hidden, out = prefix_forward(model, samples, pad_id, "hidden")
    everything = slice(None)
    loss, logp, ent = linear_logprob_loss(hidden[real], _head_weight(model, out), ids[real],
                                          lambda lp, en, rows: loss_of(padded(lp, rows), padded(en, rows)), temperature,
                                          value_of=lambda lp, en: loss_of(padded(lp, everything), padded(en, everything)))
    return loss, padded(logp, everything), padded(ent, everything)


def completion_reverse_kl_loss(model, samples: list, pad_id: int, teacher: list[torch.Tensor], temperature: float,
                               token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `token_weights` [samples, longest] times the KL, the KL detached): the full-vocabulary
    KL(student || teacher) [samples, longest completion] at each sample's generated positions (0 elsewhere);
    `teacher[i]` holds the teacher's log-probabilities there, [generated, vocab]. On the fused path the gradient is
    made in the forward (`kernels.reverse_kl.linear_reverse_kl_loss`)."""
    dev = next(model.parameters()).device
    mask = pad_rows([s.gen_mask for s in samples], 0, device=dev) > 0
    lt = torch.cat([t.float() for t in teacher]).to(dev)
    w = token_weights.to(dev)[mask].float()
    if not fused(model):
        ls = torch.log_softmax(prefix_forward(model, samples, pad_id).float() / temperature, -1)[mask]
        kl = (ls.exp() * (ls - lt)).sum(-1)
        loss = (kl * w).sum()
    else:
        hidden, out = prefix_forward(model, samples, pad_id, "hidden")
        loss, kl = linear_reverse_kl_loss(hidden[mask], _head_weight(model, out), lt,
                                          lambda k, rows: (k * w[rows]).sum(), temperature)
    return loss, kl.detach().new_zeros(mask.shape).masked_scatter(mask, kl.detach())
