"""Per-document text rules for curate: normalisation with mojibake repair, quality heuristics, PII scrubbing."""
from __future__ import annotations

import re
import unicodedata
from collections import Counter

import ftfy

PII = [
    (re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.]+\b"), "<EMAIL>"),
    (re.compile(r"\+?\d{1,3}[-. ]\d{3}[-. ]\d{3}[-. ]\d{4}\b"), "<PHONE>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b"), "<IP>"),
    (re.compile(r"\b(?:sk|pk|api|key)[-_][A-Za-z0-9]{16,}\b"), "<KEY>"),
]
BOILERPLATE = re.compile(r"all rights reserved|click here|cookie|subscribe|terms of (?:use|service)|privacy policy|"
                         r"lorem ipsum|enable javascript|sign up|log in", re.I)
SENTENCE = re.compile(r"[^.!?\n]+")
SYMBOLS = frozenset("#$%&*@~^|<>{}[]\\_=`")


def normalise(text: str) -> tuple[str, bool]:
    """NFC, mojibake repaired (ftfy), whitespace trimmed; and whether the repair changed anything.

    ASCII text cannot hold mojibake, so only non-ASCII text pays for ftfy.
    """
    repaired = False
    if not text.isascii():
        fixed = ftfy.fix_text(text, normalization="NFC")
        repaired = fixed != unicodedata.normalize("NFC", text)
        text = fixed
    return text.strip(), repaired


def _dup_ngram_share(words: list[str], n: int) -> float:
    """Share of characters inside word n-grams that occur more than once (Gopher-style repetition)."""
    if len(words) < 2 * n:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = bytearray(len(words))
    for i, g in enumerate(grams):
        if counts[g] > 1:
            covered[i:i + n] = b"\1" * n
    total = sum(map(len, words))
    return sum(len(w) for w, c in zip(words, covered) if c) / total if total else 0.0


def quality(text: str, words: list[str], c) -> str | None:
    """The first quality rule the document breaks, or None. `c` is the CurateConfig."""
    n = len(text)
    if n < c.min_chars:
        return "too_short"
    if n > c.max_chars:
        return "too_long"
    if sum(map(str.isalpha, text)) / n < c.min_alpha_ratio:
        return "low_alpha_ratio"
    if sum(ch in SYMBOLS for ch in text) / n > c.max_symbol_ratio:
        return "high_symbol_ratio"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 3 and len(set(lines)) / len(lines) < 0.5:
        return "repeated_lines"
    if _dup_ngram_share(words, c.repeat_ngram) > c.max_repeat_share:
        return "repeated_ngrams"
    sentences = [s for s in SENTENCE.findall(text) if s.strip()]
    if sentences and sum(bool(BOILERPLATE.search(s)) for s in sentences) / len(sentences) > c.max_boilerplate_share:
        return "boilerplate"
    return None


def scrub_pii(text: str) -> tuple[str, dict[str, int]]:
    hits = {}
    for pattern, placeholder in PII:
        text, n = pattern.subn(placeholder, text)
        if n:
            hits[placeholder] = n
    return text, hits
