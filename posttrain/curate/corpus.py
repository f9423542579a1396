"""The embedded default's raw corpus: task-world prose with planted mess and known ground truth.

Clean documents are unique. Planted: exact and near duplicates (each of a distinct original, `dup_of`
names it), junk, repetitive and boilerplate pages, mojibake, PII-like strings and test-set
contamination. The labels ride along in `meta` for measuring curation; curation never reads them.
"""
from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import environments
from environments.long_context import FILLER

PLANTS = {"exact_dup": 0.04, "near_dup": 0.05, "junk": 0.02, "repetitive": 0.01, "boilerplate": 0.01,
          "mojibake": 0.01, "pii": 0.03, "contamination": 0.02}
ACCENTED = "café crème brûlée naïve résumé façade jalapeño über déjà vu".split()
BOILER = ["Click here to subscribe.", "All rights reserved.", "We use cookies to improve your experience.",
          "Read our privacy policy.", "Sign up for the newsletter.", "Terms of use apply."]


def _filler(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(n)).capitalize() + "."


def _pii(rng: random.Random) -> str:
    return rng.choice([
        f"contact me at user{rng.randint(1, 999)}@example.com",
        f"call +1-555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
        f"server at 10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        "key sk-" + "".join(rng.choice("abcdef0123456789") for _ in range(32)),
    ])


def _pool(domain: str, want: int, seed: int, knobs: dict) -> list:
    """Up to `want` distinct train tasks (small worlds hold fewer)."""
    while want:
        try:
            return environments.get(domain).generate("train", want, seed, **knobs)
        except ValueError:
            want //= 2
    return []


def _clean(rng: random.Random, pools: list[list]) -> str:
    kind = rng.random()
    if kind < 0.6 and pools:
        # worked examples under a unique lead: bare templated Q/A pairs would be near duplicates of each other
        # and from different domains: a page of one template repeats itself (the repetition rule would drop it)
        picked = rng.sample(pools, rng.randint(1, len(pools)))
        examples = [pool.pop().prose() for pool in picked]
        pools[:] = [p for p in pools if p]
        return " ".join([_filler(rng, rng.randint(15, 40)), *examples])
    if kind < 0.8:
        fact = f"The secret code is {rng.randint(1000, 9999)}."
        return f"{_filler(rng, rng.randint(10, 60))} {fact} {_filler(rng, rng.randint(10, 60))}"
    return _filler(rng, rng.randint(20, 80))


def _planted(kind: str, rng: random.Random, tests: list, original: dict | None) -> str:
    if kind == "exact_dup":
        return original["text"]
    if kind == "near_dup":
        words = original["text"].split()
        j = rng.randrange(len(words))
        words[j] = rng.choice([w for w in FILLER if w != words[j].lower()])
        return " ".join(words)
    if kind == "junk":
        return "".join(rng.choice("#$%&*@!~^|<>{}[]0123456789") for _ in range(rng.randint(40, 200)))
    if kind == "repetitive":
        return " ".join([f"buy {rng.choice(FILLER)} now"] * rng.randint(10, 30))
    if kind == "boilerplate":
        return " ".join(rng.sample(BOILER, 4))
    if kind == "mojibake":  # UTF-8 read as cp1252, the classic web-scrape garbling
        text = f"{_filler(rng, 10)} {' '.join(rng.sample(ACCENTED, 3))} {_filler(rng, 10)}"
        return text.encode("utf-8").decode("cp1252")
    if kind == "pii":
        return f"{_filler(rng, 20)} {_pii(rng)}. {_filler(rng, 10)}"
    t = rng.choice(tests)
    return f"{_filler(rng, 8)} {t.fingerprint()} The answer is {t.answer}. {_filler(rng, 8)}"


def generate_raw(folder: Path, n_docs: int, seed: int, world, docs_per_file: int = 25_000) -> dict:
    """Write the raw corpus as JSONL.gz files in `folder` (at least two, so curate runs them in
    parallel); return the planted counts (ground truth)."""
    rng = random.Random(seed)
    domains = environments.names(world.environments)
    pools = [p for d in domains if (p := _pool(d, n_docs // 4, seed + 1, world.knobs(d)))]
    for p in pools:
        rng.shuffle(p)
    tests = [t for d in domains
             for t in environments.get(d).generate("test", world.n_test, seed, **world.knobs(d))]
    docs: list[dict] = []
    seen: set[str] = set()
    while len(docs) < int(n_docs * (1 - sum(PLANTS.values()))):
        text = _clean(rng, pools)
        if text not in seen:
            seen.add(text)
            i = len(docs)
            docs.append({"id": f"doc-{seed}-{i}", "text": text, "source": "web" if i % 10 else "books",
                         "meta": {"planted": "clean"}})
    n_near, n_exact = int(n_docs * PLANTS["near_dup"]), int(n_docs * PLANTS["exact_dup"])
    near_of = rng.sample([d for d in docs if len(d["text"].split()) > 30], n_near)
    taken = {d["id"] for d in near_of}
    originals = {"near_dup": iter(near_of), "exact_dup": iter(rng.sample([d for d in docs if d["id"] not in taken],
                                                                         n_exact))}
    planted = {k: 0 for k in PLANTS}
    for kind, share in PLANTS.items():
        for _ in range(int(n_docs * share)):
            original = next(originals[kind]) if kind in originals else None
            meta = {"planted": kind, **({"dup_of": original["id"]} if original else {})}
            docs.append({"id": f"doc-{seed}-{len(docs)}", "text": _planted(kind, rng, tests, original), "source": "web",
                         "meta": meta})
            planted[kind] += 1
    rng.shuffle(docs)
    folder.mkdir(parents=True, exist_ok=True)
    n_files = max(2, -(-len(docs) // docs_per_file))
    for i in range(n_files):
        # mtime 0: gzip's header would otherwise hold the write time, and the same corpus would get a new digest in
        # every run (every node downstream of raw then computed again instead of shared)
        with open(folder / f"corpus-{i:05d}.jsonl.gz", "wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3, mtime=0) as gz, \
                io.TextIOWrapper(gz, encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs[i::n_files])
    return {"docs": len(docs), "files": n_files, **planted}
