"""The model's output at every completion position with each distinct prompt run once (`prefix_forward`), and the
prefill it is built on (`prefill_distinct`), shared by the trainers and the rollout engines.

The samples of one group share their prompt; a full-sequence forward would redo the prompt for every
sample (8x for GRPO's groups). Here each distinct prompt runs once, its KV cache is indexed out to its
samples, and the completions run on top. Gradients flow through the shared cache (indexing sums them),
so the loss and its gradient equal the full-sequence forward's; only the repeated work is gone.

A sample is anything with `prompt_ids` and `ids` (token id lists): posttrain.rl.workers.Sample, a namespace."""
from __future__ import annotations

import torch

from posttrain.models.attention import reads_documents
from posttrain.models.kv_cache import training_cache


def prefill_distinct(model, prompts: list[list[int]], pad_id: int, cache=None, **extra):
    """Run each distinct prompt once (left-padded) and index its KV cache (`cache`, default transformers'
    DynamicCache) out to every row that has it.

    Returns (the model's output for the distinct prompts, the per-row cache, the per-row attention mask,
    `which`: row -> distinct prompt). Groups of samples share a prompt; this is where they share its work."""
    uniq: dict[tuple[int, ...], int] = {}
    dev = next(model.parameters()).device
    which = torch.tensor([uniq.setdefault(tuple(p), len(uniq)) for p in prompts], device=dev)
    L = max(map(len, uniq))
    ids = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in uniq], device=dev)
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in uniq], device=dev)
    cache = training_cache(model) if cache is None else cache
    if hasattr(model, "lm_head"):  # a causal LM computes logits only where they are used: the last position
        extra["logits_to_keep"] = 1
    out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache, use_cache=True, **extra)
    cache.batch_select_indices(which)
    return out, cache, attn[which], which


def pad_rows(rows: list[list], value, dtype=None, device=None) -> torch.Tensor:
    n = max(1, max(map(len, rows)))
    return torch.tensor([list(r) + [value] * (n - len(r)) for r in rows], dtype=dtype, device=device)


def micro_batches(samples: list, max_cells: int) -> list[list[int]]:
    """Sample indices sorted by completion length and cut so a micro-batch pads to at most ~`max_cells`
    completion cells: short completions no longer pad to the longest of the whole batch."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    chunks: list[list[int]] = [[]]
    for i in order:  # ascending, so sample i is the longest of its chunk so far
        if chunks[-1] and (len(chunks[-1]) + 1) * len(samples[i].ids) > max_cells:
            chunks.append([])
        chunks[-1].append(i)
    return chunks


def prefix_forward(model, samples: list, pad_id: int, output: str = "logits"):
    """`output` ("logits" or "last_hidden_state") at the position predicting each completion token:
    result[:, j] is computed from the prompt and ids[:j], shape [samples, longest completion, dim].
    "hidden" (a causal LM's last hidden state, its head run on one position only, posttrain.models.head) returns
    (that, the model's output for the completions).

    Where the model reads packed documents from the positions (posttrain.models.attention.padding_free) and its
    prompts are not shared enough to pay for the padding, each sample runs whole, the batch as one row
    without padding (`flat_forward`)."""
    if reads_documents(model) and flat_tokens(samples) < cached_tokens(samples):
        return flat_forward(model, samples, output)
    hidden = output == "hidden"
    extra = {"output_hidden_states": True, "logits_to_keep": 1} if hidden else {}
    head, cache, p_att, which = prefill_distinct(model, [s.prompt_ids for s in samples], pad_id, **extra)
    c_ids = pad_rows([s.ids for s in samples], pad_id, device=p_att.device)
    c_att = pad_rows([[1] * len(s.ids) for s in samples], 0, device=p_att.device)
    tail = model(input_ids=c_ids, attention_mask=torch.cat([p_att, c_att], 1),
                 position_ids=p_att.sum(-1)[:, None] + torch.arange(c_ids.size(1), device=p_att.device),
                 past_key_values=cache,
                 use_cache=True, **extra)
    if hidden:
        first, rest = head.hidden_states[-1][:, -1][which], tail.hidden_states[-1]
    else:
        first, rest = getattr(head, output)[:, -1][which], getattr(tail, output)
    out = torch.cat([first[:, None], rest[:, :-1]], 1)
    return (out, tail) if hidden else out


def flat_tokens(samples: list) -> int:
    """Tokens `flat_forward` runs: every sample's prompt and completion."""
    return sum(len(s.prompt_ids) + len(s.ids) for s in samples)


def cached_tokens(samples: list) -> int:
    """Token slots the cached path runs: each distinct prompt once, padded to the longest, then every
    completion padded to the longest."""
    distinct = {tuple(s.prompt_ids) for s in samples}
    return len(distinct) * max(map(len, distinct)) + len(samples) * max(1, max(len(s.ids) for s in samples))


def flat_forward(model, samples: list, output: str = "logits"):
    """prefix_forward's result from one row holding each sample's prompt and completion, positions restarting
    at each: no padding and no cache; the output head runs where a completion token is predicted only."""
    dev = next(model.parameters()).device
    rows = [list(s.prompt_ids) + list(s.ids) for s in samples]
    ids = torch.tensor([t for r in rows for t in r], device=dev)[None]
    pos = torch.cat([torch.arange(len(r)) for r in rows]).to(dev)[None]
    at, keep = 0, []
    for r, s in zip(rows, samples):  # the position predicting completion token j: the one before it
        keep.extend(range(at + len(s.prompt_ids) - 1, at + len(r) - 1))
        at += len(r)
    keep = torch.tensor(keep, dtype=torch.long, device=dev)
    real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, dev)
    out = None
    if output == "last_hidden_state":
        vals = model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0, keep]
    elif output == "hidden":
        out = model(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        vals = out.hidden_states[-1][0, keep]
    else:
        vals = getattr(model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep), output)[0]
    res = vals.new_zeros(*real.shape, vals.shape[-1])
    res[real] = vals
    return (res, out) if output == "hidden" else res
