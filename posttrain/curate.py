"""curate: normalise, dedup (exact + MinHash LSH), quality filters, PII scrub, decontaminate, split.

Accounting is exact: rows in = rows kept + rows rejected by reason; rejected rows go to a
quarantine Parquet with their reason.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import re
import shutil
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from datasketch import MinHash, MinHashLSH

import environments
from posttrain.config import PipelineConfig
from posttrain.corpus import generate_raw

PII = [
    (re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.]+\b"), "<EMAIL>"),
    (re.compile(r"\+?\d{1,3}[-. ]\d{3}[-. ]\d{3}[-. ]\d{4}\b"), "<PHONE>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b"), "<IP>"),
    (re.compile(r"\b(?:sk|pk|api|key)[-_][A-Za-z0-9]{16,}\b"), "<KEY>"),
]
QUARANTINE_SCHEMA = pa.schema([(k, pa.string()) for k in ("id", "text", "reason", "detail")])


class BadRow(ValueError):
    pass


def make_raw(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    """The raw corpus artifact: the user's files copied in, or the generated default corpus."""
    c = cfg.curate
    if c.inputs:
        files = sorted({f for pattern in c.inputs for f in glob.glob(pattern)})
        if not files:
            raise FileNotFoundError(f"curate.inputs matched no file: {c.inputs}")
        for f in files:
            shutil.copy(f, out / Path(f).name)
        return {"metrics": {"files": len(files)}}
    planted = generate_raw(out / "corpus.jsonl.gz", c.raw_docs, cfg.seed, cfg.world)
    (out / "planted.json").write_text(json.dumps(planted, indent=1))
    return {"metrics": {f"planted_{k}": v for k, v in planted.items()}}


def read_rows(folder: Path, text_field: str) -> Iterator[tuple[dict | None, str, str]]:
    """Yield (row or None, where, problem) for every line of every JSONL(.gz) / Parquet file."""
    for path in sorted(folder.iterdir()):
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    where = f"{path.name}:{lineno}"
                    try:
                        row = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        yield None, where, f"malformed line: {type(e).__name__}"
                        continue
                    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                        yield None, where, f"field {text_field!r} missing or not a string"
                        continue
                    yield row, where, ""
        elif path.suffix == ".parquet":
            for i, row in enumerate(pq.read_table(path).to_pylist()):
                yield row, f"{path.name}:{i + 1}", ""


def _quality(text: str, c) -> str | None:
    if len(text) < c.min_chars:
        return "too_short"
    if len(text) > c.max_chars:
        return "too_long"
    if sum(ch.isalpha() for ch in text) / len(text) < c.min_alpha_ratio:
        return "low_alpha_ratio"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 3 and len(set(lines)) / len(lines) < 0.5:
        return "repeated_lines"
    return None


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _shingles(words: list[str], n: int) -> set[str]:
    return {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def _write(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path, compression="zstd")


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    c, w = cfg.curate, cfg.world
    knobs = w.knobs()
    domains = environments.names(w.environments)
    tests = {d: environments.get(d).generate("test", w.n_test, cfg.seed, **knobs) for d in domains}
    # a test prompt quoted anywhere in a document contaminates it (prompts are short templated text,
    # so shared word n-grams would flag every document of the same template)
    test_prompts = {_norm(t.prompt) for ts in tests.values() for t in ts}
    lsh = MinHashLSH(threshold=c.near_dup_threshold, num_perm=c.num_perm)
    seen_exact: set[str] = set()
    kept, quarantine = [], []
    reasons: Counter = Counter()
    n_in = 0
    pii_hits: Counter = Counter()
    for row, where, problem in read_rows(Path(inputs["raw"]), c.text_field):
        n_in += 1
        if row is None:
            if c.on_bad_row == "fail":
                raise BadRow(f"{where}: {problem} (set curate.on_bad_row=quarantine to keep going)")
            reasons["bad_row"] += 1
            quarantine.append({"id": where, "text": "", "reason": "bad_row", "detail": problem})
            continue
        text = unicodedata.normalize("NFC", row[c.text_field]).strip()
        rid = str(row.get("id", where))
        reason = None
        h = hashlib.sha256(text.encode()).hexdigest()
        if h in seen_exact:
            reason = "exact_dup"
        else:
            seen_exact.add(h)
            reason = _quality(text, c)
        normed = _norm(text)
        words = normed.split()
        if reason is None and any(p in normed for p in test_prompts):
            reason = "contamination"
        if reason is None:
            mh = MinHash(num_perm=c.num_perm, seed=cfg.seed)
            mh.update_batch([s.encode() for s in _shingles(words, c.shingle_size)])
            if lsh.query(mh):
                reason = "near_dup"
            else:
                lsh.insert(rid, mh)
        if reason:
            reasons[reason] += 1
            quarantine.append({"id": rid, "text": text, "reason": reason, "detail": ""})
            continue
        for pattern, placeholder in PII:
            text, n = pattern.subn(placeholder, text)
            pii_hits[placeholder] += n
        kept.append({"id": rid, "text": text, "source": str(row.get("source", "unknown"))})
    if n_in != len(kept) + sum(reasons.values()):
        raise AssertionError("curate accounting broken: rows in != kept + rejected")
    if not kept:
        raise ValueError("curate kept no rows: every input row was rejected (see quarantine reasons)")

    n_shards = 2
    for i in range(n_shards):
        _write(out / f"pretrain-{i:05d}.parquet", kept[i::n_shards])
    pq.write_table(pa.Table.from_pylist(quarantine, schema=QUARANTINE_SCHEMA), out / "quarantine.parquet",
                   compression="zstd")
    split_counts = {}
    for d in domains:
        env = environments.get(d)
        train = env.generate("train", w.n_train, cfg.seed, **knobs)
        n_sft = int(len(train) * 0.75)
        sets = {"sft": train[:n_sft], "rl": train[n_sft:], "val": env.generate("val", w.n_val, cfg.seed, **knobs),
                "test": tests[d]}
        ids = [t.id for s in sets.values() for t in s]
        if len(ids) != len(set(ids)):
            raise AssertionError(f"{d}: splits are not disjoint")
        for name, tasks in sets.items():
            _write(out / f"{name}-{d}.parquet", [{"id": t.id, "task": t.to_json()} for t in tasks])
            split_counts[f"{name}_{d}"] = len(tasks)
    card = {"rows_in": n_in, "rows_kept": len(kept), "rejected": dict(reasons), "pii_scrubbed": dict(pii_hits),
            "sources": dict(Counter(r["source"] for r in kept)), "splits": split_counts,
            "chars_kept": sum(len(r["text"]) for r in kept)}
    (out / "data_card.json").write_text(json.dumps(card, indent=1))
    metrics = {"rows_in": n_in, "rows_kept": len(kept), **{f"rejected_{k}": v for k, v in reasons.items()},
               **{f"pii_{k.strip('<>').lower()}": v for k, v in pii_hits.items()}}
    return {"metrics": metrics, "datasets": [("raw", inputs["raw"])]}


def load_tasks(folder: str | Path, name: str, domain: str) -> list:
    from environments.base import Task
    table = pq.read_table(Path(folder) / f"{name}-{domain}.parquet")
    return [Task.from_json(s) for s in table.column("task").to_pylist()]


def load_pretrain_texts(folder: str | Path) -> list[str]:
    return [t for p in sorted(Path(folder).glob("pretrain-*.parquet")) for t in pq.read_table(p).column("text").to_pylist()]
