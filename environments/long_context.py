"""A fact buried in filler at a given length; the answer must quote it."""
from __future__ import annotations

import random
from typing import Callable

from environments.base import Task, collect, verify_number

DOMAIN = "long_context"
FILLER = ("the old road ran past a quiet field where birds sang in the warm light and people walked "
          "slowly home after a long day while clouds moved over hills near a small river town").split()


def _make(n_words: int, digits: int = 4):
    def make(rng: random.Random) -> tuple[str, Task]:
        code = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        words = [rng.choice(FILLER) for _ in range(n_words)]
        pos = rng.randint(0, len(words))
        fact = f"The secret code is {code}."
        text = " ".join(words[:pos] + [fact] + words[pos:])
        prompt = f"{text}\nWhat is the secret code?"
        return f"{code}:{pos}:{n_words}:{rng.random()}", Task(
            id="", domain=DOMAIN, split="", prompt=prompt, answer=code, meta={"n_words": n_words, "pos": pos},
            demo=[{"role": "assistant", "reasoning_content": fact, "content": code}])
    return make


def generate(split: str, n: int, seed: int, n_words: int = 40, digits: int = 4, **_) -> list[Task]:
    # the key includes a random draw, so splits differ by seed stream, and by code/position otherwise
    return collect(DOMAIN, split, n, seed, _make(n_words, digits))


def fit_to_length(split: str, n: int, seed: int, max_tokens: int,
                  count_tokens: Callable[[list[Task]], list[int]], digits: int = 4) -> list[Task]:
    """Largest filler whose rendered prompt fits `max_tokens` (measured with the real tokenizer: `count_tokens`
    takes a list, so a tokenizer counts them in one batched call); codes of `digits` digits (the benchmark's are 4)."""
    lo, hi = 0, max_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        probe = generate(split, 4, seed, n_words=mid, digits=digits)
        if max(count_tokens(probe)) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    tasks = generate(split, n, seed, n_words=lo, digits=digits)
    return [t for t, c in zip(tasks, count_tokens(tasks)) if c <= max_tokens] or tasks[:1]


verify = verify_number
