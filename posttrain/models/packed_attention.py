"""Attention "packed_sdpa": packed documents attend inside themselves at the cost of their own lengths.

With packed rows (positions restarting at each document, no attention mask), transformers' sdpa builds a
block-diagonal causal [B, 1, T, T] mask, and sdpa with a mask computes every one of the T*T scores (its
fused causal kernel skips the upper triangle only for `is_causal` without a mask). Here the documents are
cut out of the rows, grouped by length (rounded up to a power of two, at most T), and each group runs sdpa
with `is_causal`: the work is the sum of the documents' squared lengths instead of B*T^2. No library
kernel does this on CPU (flash-attention's varlen kernels are CUDA only; flex attention needs a compiler).

"varlen_sdpa" is the same path at every length: for a batch flattened into one row of documents with no padding
(posttrain.models.attention.padding_free, SFT's batches), where the row is as long as the whole batch and a dense mask
would cost its length squared. On the ramp's own rows grouping loses below MIN_LEN (tiny model, 2 CPU cores,
pretraining-like documents: 12,100 against 14,250 tokens/s at 256, 10,750 against 11,600 at 512; many short
groups, each an sdpa call), which is why "packed_sdpa" keeps the dense mask there.

Only rows of at least `MIN_LEN` tokens take that path; shorter ones run plain sdpa with its mask, which was
as fast or faster there (one measurement of a tiny-ramp training step, B8, 2 CPU cores, grouping at every
length: 0.17 s against 0.18 s at 256 tokens, 0.40 against 0.39 at 512, 1.05 against 0.83 at 1024; from 1024
on, `python -m bench ramp` compares the two). Decoding steps (a few queries against a KV cache) take
`decode_attention` on CPU; rollout engines switch an sdpa model to packed_sdpa for it
(posttrain.models.attention.fast_decoding). Anything else (a padding mask, a prefill into a KV cache, a model with
sliding-window layers, whose window lives in the mask) runs transformers' sdpa unchanged.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

MIN_LEN = 1024
# at most this many queries against a longer cache take decode_attention, on CPU (where it was measured), while
# its scores [B, H, T, S] stay under DECODE_CELLS floats (sdpa's kernels never hold them all)
DECODE_MAX, DECODE_CELLS = 16, 1 << 24

Plan = tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]
_last: tuple = (None, None, None)  # (weak reference to the position ids, batch shape, plan): one forward's layers share it


def document_plan(position_ids: torch.Tensor, batch: int) -> Plan:
    """The documents of the rows as length groups: each group's shape (n documents, P slots), the flat token
    index of every slot, group after group (past a document's end: its last token, which `is_causal` hides
    from the real queries), and for each token its slot in that order. A document starts where a position is
    not the previous one plus 1 (transformers' rule for packed sequences).

    Flat indices, so that each layer gathers with one `index_select` per tensor: its backward is an
    `index_add_`, where advanced indexing's is a serial accumulating `index_put_` (7% of an SFT step)."""
    pos = position_ids.expand(batch, -1).cpu()
    B, T = pos.shape
    starts = torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != 1
    starts[:, 0] = True
    b, s = starts.nonzero(as_tuple=True)
    first = b * T + s
    ends = torch.minimum(torch.cat([first[1:], torch.tensor([B * T])]), (b + 1) * T)
    groups: dict[int, list[tuple[int, int]]] = {}
    for st, n in zip(first.tolist(), (ends - first).tolist()):
        groups.setdefault(min(T, 1 << (n - 1).bit_length()), []).append((st, n))
    shapes, src, dst = [], [], torch.empty(B * T, dtype=torch.long)
    offset = 0
    for P, docs in sorted(groups.items()):
        st, n = torch.tensor([d[0] for d in docs]), torch.tensor([d[1] for d in docs])
        slots = torch.arange(P)[None, :]
        real = slots < n[:, None]
        index = st[:, None] + torch.minimum(slots, n[:, None] - 1)
        dst[index[real]] = offset + real.flatten().nonzero().squeeze(1)
        shapes.append((len(docs), P))
        src.append(index.flatten())
        offset += len(docs) * P
    return shapes, torch.cat(src).to(position_ids.device), dst.to(position_ids.device)


def _plan_for(position_ids: torch.Tensor, batch: int) -> Plan:
    global _last
    ref, shape, plan = _last
    if ref is None or ref() is not position_ids or shape != (batch, *position_ids.shape):
        plan = document_plan(position_ids, batch)
        _last = (weakref.ref(position_ids), (batch, *position_ids.shape), plan)
    return plan


def packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, H, T, D], k/v [B, Hkv, T, D] -> ([B, T, H, D], None)."""
    return _grouped_sdpa(MIN_LEN, module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """packed_sdpa at every row length."""
    return _grouped_sdpa(1, module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _grouped_sdpa(min_len: int, module, query, key, value, attention_mask, dropout: float, scaling: float | None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    position_ids = kwargs.get("position_ids")
    B, H, T, D = query.shape
    if query.device.type == "cpu" and T <= DECODE_MAX and T < key.shape[2] <= DECODE_CELLS // (B * H * T) \
            and (attention_mask is not None or T == 1) and not dropout and "s_aux" not in kwargs:
        return decode_attention(query, key, value, attention_mask, scaling), None
    if attention_mask is not None or position_ids is None or T < min_len or key.shape[2] != T \
            or kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    shapes, src, dst = _plan_for(position_ids, B)
    rep = H // key.shape[1]
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], D).index_select(0, src) for x in (query, key, value))
    outs, at = [], 0
    for n, P in shapes:
        qg, kg, vg = (x[at:at + n * P].view(n, P, x.shape[1], D).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qg, repeat_kv(kg, rep), repeat_kv(vg, rep), dropout_p=dropout,
                                           scale=scaling, is_causal=True)
        outs.append(o.transpose(1, 2).reshape(n * P, H, D))
        at += n * P
    return torch.cat(outs).index_select(0, dst).view(B, T, H, D), None


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None) -> torch.Tensor:
    """A few new queries against a KV cache (decoding; a speculative verification): q [B, H, T, D], k/v
    [B, Hkv, S, D], `mask` [B, 1, T, S] boolean or additive (None: every key) -> [B, T, H, D].

    Two matmuls with each key head's queries side by side, no copies of the keys per query head: on CPU twice as
    fast as sdpa's kernel at decode shapes (128 rows, 4 heads over 1, 20-80 keys: 50 against 102 us, 105
    against 188), whose flash kernel is built for long queries. A fully masked query attends evenly (no NaN)."""
    B, H, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    rep = H // Hkv  # query head h reads key head h // rep (transformers' repeat_kv)
    scores = query.reshape(B, Hkv, rep * T, D) @ key.transpose(-1, -2) * (scaling or D ** -0.5)
    if mask is not None:
        mask = mask.expand(B, 1, T, S)
        mask = mask[:, :, None].expand(B, 1, rep, T, S).reshape(B, 1, rep * T, S) if T > 1 and rep > 1 else mask
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
            else scores + mask
    return (scores.softmax(-1) @ value).view(B, H, T, D).transpose(1, 2)


def packed_mask(*args, **kwargs):
    """No mask where packed_sdpa reads the documents from the positions itself; sdpa's mask everywhere else."""
    return _mask(MIN_LEN, *args, **kwargs)


def varlen_mask(*args, **kwargs):
    return _mask(1, *args, **kwargs)


def _mask(min_len: int, *args, attention_mask=None, q_length: int = 0, kv_length: int = 0, q_offset=0, kv_offset=0,
          **kwargs):
    windowed = getattr(kwargs.get("config"), "sliding_window", None)
    if attention_mask is None and q_length == kv_length >= min_len and int(q_offset) == 0 and int(kv_offset) == 0 \
            and not windowed:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, **kwargs)
