"""Hashing for curate, batched over many documents with numpy: word-window hashes (MinHash shingles and
test-item matching), MinHash signatures, LSH band keys, and the global dedup over per-shard key files.

Why not datasketch's MinHashLSH directly: it keeps the whole index in memory (it grows with the corpus)
and hashes one document per call. datasketch still picks the band layout for the configured threshold;
signatures are computed for a whole batch at once and the bands are matched by sorting key files on disk,
so memory stays at a few bytes per document however large the corpus.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from datasketch.lsh import _optimal_param

from posttrain.data import hash64

TOKEN = re.compile(r"\w+|[^\w\s]")
_BASE = 0x9E3779B97F4A7C15  # odd, so it has an inverse mod 2^64
_BASE_INV = pow(_BASE, -1, 1 << 64)


class WordHashes(dict):
    """word -> stable 64-bit hash, memoised (cleared past `limit` entries to stay bounded)."""

    def __init__(self, limit: int = 1_000_000):
        super().__init__()
        self.limit = limit

    def __missing__(self, word: str) -> int:
        if len(self) >= self.limit:
            self.clear()
        v = self[word] = hash64(word)
        return v


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def flat_ids(token_lists: list[list[str]], words: WordHashes) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated word hashes of a batch and each document's start offset (len n+1)."""
    lens = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter((words[w] for ts in token_lists for w in ts), np.uint64, int(offsets[-1]))
    return flat, offsets


def _powers(base: int, n: int) -> np.ndarray:
    p = np.full(max(n, 1), base, np.uint64)
    p[0] = 1
    return np.cumprod(p, dtype=np.uint64)  # wraps mod 2^64 by design


def _prefix(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Polynomial prefix hashes of the batch and the inverse powers that make windows position-independent."""
    with np.errstate(over="ignore"):
        prefix = np.zeros(len(flat) + 1, np.uint64)
        np.cumsum(flat * _powers(_BASE, len(flat)), out=prefix[1:])
    return prefix, _powers(_BASE_INV, len(flat) + 1)


def window_hashes(flat: np.ndarray, offsets: np.ndarray, width: int, short: bool,
                  pre: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Position-independent hashes of every `width`-token window of every document.

    Returns (hashes, doc index of each). A document shorter than `width` gives one hash of all its
    tokens when `short` (MinHash shingles) and nothing otherwise (test-item matching). `pre`: `_prefix(flat)`,
    when the caller hashes several widths of the same batch.
    """
    prefix, inv = pre or _prefix(flat)
    lens = np.diff(offsets)
    counts = np.maximum(lens - width + 1, 0)
    if short:
        counts = np.maximum(counts, 1)
    doc = np.repeat(np.arange(len(lens)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    starts = offsets[:-1][doc] + (np.arange(len(doc)) - first)
    ends = np.minimum(starts + width, offsets[1:][doc])
    with np.errstate(over="ignore"):
        return (prefix[ends] - prefix[starts]) * inv[starts], doc


def sorted_member(sorted_values: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(is x[i] in sorted_values, its position there) for every element of x."""
    pos = np.searchsorted(sorted_values, x)
    if not len(sorted_values):
        return np.zeros(len(x), bool), pos
    return sorted_values[np.minimum(pos, len(sorted_values) - 1)] == x, pos


def contains_windows(flat: np.ndarray, offsets: np.ndarray, targets: dict[int, np.ndarray]) -> np.ndarray:
    """Per document: does it contain any target token sequence? `targets`: width -> sorted window hashes."""
    hit = np.zeros(len(offsets) - 1, bool)
    pre = _prefix(flat)
    for width, wanted in targets.items():
        h, doc = window_hashes(flat, offsets, width, short=False, pre=pre)
        hit[doc[sorted_member(wanted, h)[0]]] = True
    return hit


def target_windows(texts: list[str]) -> dict[int, np.ndarray]:
    """The window hashes to look for, grouped by length in tokens."""
    words = WordHashes()
    by_width: dict[int, list[int]] = {}
    for t in texts:
        toks = tokenize(t)
        if toks:
            flat, offsets = flat_ids([toks], words)
            by_width.setdefault(len(toks), []).append(int(window_hashes(flat, offsets, len(toks), True)[0][0]))
    return {w: np.unique(np.array(v, np.uint64)) for w, v in by_width.items()}


class MinHasher:
    """MinHash signatures by multiply-shift hashing of 64-bit shingle hashes, num_perm at a time."""

    def __init__(self, num_perm: int, threshold: float, seed: int):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) | np.uint64(1)
        self.b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self.bands, self.rows = _optimal_param(threshold, num_perm, 0.5, 0.5)
        self.salt = rng.integers(1, 2**63, (self.bands, self.rows), dtype=np.uint64) | np.uint64(1)

    def signatures(self, shingles: np.ndarray, doc: np.ndarray, n_docs: int) -> np.ndarray:
        """(n_docs, num_perm) uint32; every document has at least one shingle."""
        bounds = np.searchsorted(doc, np.arange(n_docs))
        out = np.empty((n_docs, len(self.a)), np.uint32)
        with np.errstate(over="ignore"):
            for j in range(0, len(self.a), 16):  # 16 permutations at a time bounds the temporary
                h = (shingles[:, None] * self.a[None, j:j + 16] + self.b[None, j:j + 16]) >> np.uint64(32)
                out[:, j:j + 16] = np.minimum.reduceat(h, bounds, axis=0)
        return out

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """(n_docs, bands) uint64: equal keys in a band make a candidate pair."""
        keys = np.empty((len(sig), self.bands), np.uint64)
        with np.errstate(over="ignore"):
            for i in range(self.bands):
                block = sig[:, i * self.rows:(i + 1) * self.rows].astype(np.uint64)
                keys[:, i] = (block * self.salt[i]).sum(axis=1, dtype=np.uint64) + np.uint64(i)
        return keys


def _read(path: Path, dtype) -> np.ndarray:
    return np.fromfile(path, dtype=dtype)


def global_dedup(shards: list[Path], bands: int, num_perm: int, threshold: float
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Across every shard's key files: (removed gidx, reason 0=exact / 1=near, the gidx it duplicates).

    The earliest document (by file, then row) of each duplicate group is kept. Near-duplicate candidates
    from any band are confirmed by the share of equal MinHash values (an unbiased Jaccard estimate).
    """
    gidx = np.concatenate([_read(s / "gidx.bin", np.uint64) for s in shards])
    exact = np.concatenate([_read(s / "exact.bin", np.uint64) for s in shards])
    order = np.lexsort((gidx, exact))
    same = np.flatnonzero(exact[order][1:] == exact[order][:-1]) + 1
    run_start = np.maximum.accumulate(np.where(np.r_[True, exact[order][1:] != exact[order][:-1]],
                                               np.arange(len(order)), 0))
    removed = {int(gidx[order[i]]): (0, int(gidx[order[run_start[i]]])) for i in same}
    del exact, order, run_start
    alive = ~np.isin(gidx, np.fromiter(removed, np.uint64, len(removed)))

    pairs = []
    for band in range(bands):
        keys = np.concatenate([_read(s / f"band{band:03d}.bin", np.uint64) for s in shards])[alive]
        ids = gidx[alive]
        order = np.argsort(keys, kind="stable")  # stable: ties stay in gidx order, so run heads are earliest
        k = keys[order]
        dup = np.r_[False, k[1:] == k[:-1]]
        head = np.maximum.accumulate(np.where(~dup, np.arange(len(k)), 0))
        pairs.append(np.stack([ids[order[head[dup]]], ids[order[dup]]], axis=1))
    pairs = np.unique(np.concatenate(pairs) if pairs else np.empty((0, 2), np.uint64), axis=0)
    if len(pairs):
        pairs = pairs[_agreement(shards, pairs, num_perm) >= threshold]
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while x != root:
            parent[x], x = root, parent.get(x, x)
        return root

    for a, b in pairs.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    for x in parent:
        root = find(x)
        if root != x:
            removed[x] = (1, root)
    out = np.array(sorted(removed), np.uint64)
    return out, np.array([removed[int(g)][0] for g in out], np.int8), np.array([removed[int(g)][1] for g in out],
                                                                                 np.uint64)


def _agreement(shards: list[Path], pairs: np.ndarray, num_perm: int) -> np.ndarray:
    """Share of equal MinHash values for each pair, read from the shards' signature files."""
    sigs = np.zeros((2, len(pairs), num_perm), np.uint32)
    shard_of = (pairs >> np.uint64(40)).astype(np.int64)
    row_of = (pairs & np.uint64((1 << 40) - 1)).astype(np.int64)
    for s_i, s in enumerate(shards):
        local = _read(s / "gidx.bin", np.uint64) & np.uint64((1 << 40) - 1)
        mm = np.memmap(s / "sigs.bin", np.uint32, "r", shape=(len(local), num_perm)) if len(local) else None
        for side in (0, 1):
            sel = shard_of[:, side] == s_i
            if sel.any():
                sigs[side, sel] = mm[np.searchsorted(local, row_of[sel, side].astype(np.uint64))]
    return (sigs[0] == sigs[1]).mean(axis=1)
