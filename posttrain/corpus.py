"""The embedded default's raw corpus: task-world prose with planted mess and known ground truth.

Planted: exact duplicates, near duplicates, junk, PII-like strings and test-set contamination. The
`planted` label rides along in `meta` for measuring curation; curation itself never reads it.
"""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import environments
from environments.long_context import FILLER

PLANTS = {"exact_dup": 0.05, "near_dup": 0.05, "junk": 0.03, "pii": 0.03, "contamination": 0.02}


def _prose(task) -> str:
    think = " ".join(m.get("reasoning_content", "") for m in task.demo if m["role"] == "assistant")
    return f"Question: {task.prompt} Reasoning: {think} Answer: {task.answer}."


def _filler(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(n)).capitalize() + "."


def _pii(rng: random.Random) -> str:
    return rng.choice([
        f"contact me at user{rng.randint(1, 999)}@example.com",
        f"call +1-555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
        f"server at 10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        "key sk-" + "".join(rng.choice("abcdef0123456789") for _ in range(32)),
    ])


def generate_raw(path: Path, n_docs: int, seed: int, world) -> dict:
    """Write a JSONL.gz raw corpus; return the planted counts (ground truth)."""
    rng = random.Random(seed)
    knobs = world.knobs()
    pools = {d: environments.get(d).generate("train", n_docs // 4, seed + 1, **knobs) for d in environments.DOMAINS}
    tests = [t for d in environments.DOMAINS
             for t in environments.get(d).generate("test", world.n_test, seed, **knobs)]
    docs: list[dict] = []
    planted = {k: 0 for k in PLANTS}
    clean_target = int(n_docs * (1 - sum(PLANTS.values())))
    for i in range(clean_target):
        kind = rng.random()
        if kind < 0.6:
            text = _prose(rng.choice(pools[rng.choice(environments.DOMAINS)]))
        elif kind < 0.8:
            fact = f"The secret code is {rng.randint(1000, 9999)}."
            text = f"{_filler(rng, rng.randint(10, 60))} {fact} {_filler(rng, rng.randint(10, 60))}"
        else:
            text = _filler(rng, rng.randint(20, 80))
        docs.append({"id": f"doc-{i}", "text": text, "source": "web" if kind < 0.9 else "books",
                     "meta": {"planted": "clean"}})
    originals = list(docs)
    for kind, share in PLANTS.items():
        for _ in range(int(n_docs * share)):
            if kind == "exact_dup":
                text = rng.choice(originals)["text"]
            elif kind == "near_dup":
                words = rng.choice([d for d in originals if len(d["text"].split()) > 30])["text"].split()
                j = rng.randrange(len(words))
                words[j] = rng.choice(FILLER)
                text = " ".join(words)
            elif kind == "junk":
                text = "".join(rng.choice("#$%&*@!~^|<>{}[]0123456789") for _ in range(rng.randint(40, 200)))
            elif kind == "pii":
                text = f"{_filler(rng, 20)} {_pii(rng)}. {_filler(rng, 10)}"
            else:
                t = rng.choice(tests)
                text = f"{_filler(rng, 8)} {t.prompt} The answer is {t.answer}. {_filler(rng, 8)}"
            planted[kind] += 1
            docs.append({"id": f"doc-{len(docs)}", "text": text, "source": "web", "meta": {"planted": kind}})
    rng.shuffle(docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    return {"docs": len(docs), **planted}
