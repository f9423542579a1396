"""Packing variable-length documents into fixed-width rows with the document boundaries kept.

Positions restart at 0 for every document and no `attention_mask` is passed: transformers (>= 4.53)
reads the restarts in `position_ids` as packed sequences and builds a block-diagonal causal mask for
sdpa / eager / flex attention (varlen kernels for flash attention), so no token attends across
documents. With `mask_documents=False` positions run on through the row: classic pretraining packing,
one causal mask over the whole row (cheaper, but documents see each other).
"""
from __future__ import annotations

import bisect

import torch

Example = tuple[list[int], list[float]]  # (token ids, loss weight per token: 0 none, 1 normal)


def pack(examples: list[Example], seq_len: int) -> list[list[Example]]:
    """Best-fit decreasing: each example goes to the fullest row it still fits; longer ones are cut into
    `seq_len` pieces first. Deterministic (stable sort), so a data order built on it resumes exactly."""
    pieces = [(ids[i:i + seq_len], m[i:i + seq_len]) for ids, m in examples for i in range(0, len(ids), seq_len)]
    order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i][0]))
    rows: list[list[Example]] = []
    free: list[tuple[int, int]] = []  # (space left, row index), sorted
    for i in order:
        n = len(pieces[i][0])
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            space, r = free.pop(j)
        else:
            space, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(pieces[i])
        if space - n:
            bisect.insort(free, (space - n, r))
    return rows


def collate(rows: list[list[Example]], pad_id: int, *, mask_documents: bool = True) -> dict[str, torch.Tensor]:
    """Rows of packed examples -> input_ids, loss_mask, position_ids (all [B, T], T = longest row).

    The first token of each document gets no loss (its "previous token" belongs to another document);
    right padding is a document of its own with no loss.
    """
    T = max(sum(len(ids) for ids, _ in row) for row in rows)
    ids = torch.full((len(rows), T), pad_id)
    loss = torch.zeros((len(rows), T))
    pos = torch.zeros((len(rows), T), dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for x, m in row:
            n = len(x)
            ids[b, at:at + n] = torch.tensor(x)
            loss[b, at + 1:at + n] = torch.tensor(m[1:], dtype=torch.float)
            pos[b, at:at + n] = torch.arange(n)
            at += n
        pos[b, at:] = torch.arange(T - at)
    if not mask_documents:
        pos = torch.arange(T).expand(len(rows), T).clone()
    return {"input_ids": ids, "loss_mask": loss, "position_ids": pos}


def packing_efficiency(rows: list[list[Example]], seq_len: int) -> float:
    """Share of row slots holding real tokens."""
    return sum(len(x) for row in rows for x, _ in row) / max(1, len(rows) * seq_len)
