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

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from datasketch import MinHash, MinHashLSH

import environments
from posttrain import curate_gates as gates
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
    """A row or file that curate cannot read; the message names file and line."""


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


DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def read_rows(folder: Path, text_field: str) -> Iterator[tuple[dict | None, str, str]]:
    """Yield (row or None, "file:line", problem) for every row of every JSONL(.gz) / Parquet file.

    An empty file yields one (None, "file:0", "empty_file"); it holds no row, so it is not counted in.
    """
    for path in sorted(p for p in folder.iterdir() if p.name.endswith(DATA_SUFFIXES)):
        n = 0
        if path.suffix == ".parquet":
            try:
                rows = pq.read_table(path).to_pylist()
            except (pa.ArrowInvalid, OSError) as e:
                raise BadRow(f"{path.name}: not a readable Parquet file ({e})") from None
            for n, row in enumerate(rows, 1):
                ok = isinstance(row.get(text_field), str)
                yield row, f"{path.name}:{n}", "" if ok else f"field {text_field!r} missing or not a string"
        else:
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    where = f"{path.name}:{n}"
                    try:
                        row = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError:
                        yield None, where, "not UTF-8 (binary or another encoding)"
                        continue
                    except json.JSONDecodeError as e:
                        yield None, where, f"malformed JSON: {e.msg}"
                        continue
                    if not isinstance(row, dict):
                        yield None, where, f"a JSON {type(row).__name__}, not an object"
                    elif not isinstance(row.get(text_field), str):
                        yield row, where, f"field {text_field!r} missing or not a string"
                    else:
                        yield row, where, ""
        if n == 0:
            yield None, f"{path.name}:0", "empty_file"


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
    kept, quarantine, as_read = [], [], []
    reasons: Counter = Counter()
    n_in = empty_files = 0
    pii_hits: Counter = Counter()
    for row, where, problem in read_rows(Path(inputs["raw"]), c.text_field):
        if problem == "empty_file":
            if c.on_bad_row == "fail":
                raise BadRow(f"{where.rsplit(':', 1)[0]}: the file is empty (set curate.on_bad_row=quarantine to skip it)")
            empty_files += 1
            quarantine.append({"id": where, "text": "", "reason": "empty_file", "detail": "no rows"})
            continue
        n_in += 1
        text = row.get(c.text_field) if row is not None and not problem else None
        rid = str(row.get(c.id_field, where)) if row is not None else where
        as_read.append({"id": rid, "text": text, "source": str((row or {}).get(c.source_field, "unknown"))})
        if problem:
            if c.on_bad_row == "fail":
                raise BadRow(f"{where}: {problem} (set curate.on_bad_row=quarantine to keep going)")
            reasons["bad_row"] += 1
            quarantine.append({"id": where, "text": "", "reason": "bad_row", "detail": problem})
            continue
        text = unicodedata.normalize("NFC", text).strip()
        h = hashlib.sha256(text.encode()).hexdigest()
        if h in seen_exact:
            reason = "exact_dup"
        else:
            seen_exact.add(h)
            reason = _quality(text, c)
        if reason is None:  # normalise only what passed the cheap checks (a 50 MB line never gets here)
            normed = _norm(text)
            if any(p in normed for p in test_prompts):
                reason = "contamination"
            else:
                mh = MinHash(num_perm=c.num_perm, seed=cfg.seed)
                mh.update_batch([s.encode() for s in _shingles(normed.split(), c.shingle_size)])
                if lsh.query(mh):
                    reason = "near_dup"
                else:
                    lsh.insert(rid, mh)
        if reason:
            reasons[reason] += 1
            quarantine.append({"id": rid, "text": text[:10_000], "reason": reason,
                               "detail": f"text truncated from {len(text)} chars" if len(text) > 10_000 else ""})
            continue
        for pattern, placeholder in PII:
            text, n = pattern.subn(placeholder, text)
            pii_hits[placeholder] += n
        kept.append({"id": rid, "text": text, "source": as_read[-1]["source"]})
    if n_in != len(kept) + sum(reasons.values()):
        raise AssertionError("curate accounting broken: rows in != kept + rejected")
    validation = [gates.validate("input", pd.DataFrame(as_read, columns=["id", "text", "source"]),
                                 gates.input_expectations())]
    del as_read
    if not kept:
        raise ValueError("curate kept no rows: every input row was rejected (see quarantine reasons)")
    out_df = pd.DataFrame(kept)
    out_df["contaminated"] = [any(p in _norm(t) for p in test_prompts) for t in out_df["text"]]
    validation.append(gates.validate("output", out_df, gates.output_expectations(c.min_chars, c.max_chars)))

    n_shards = 2
    for i in range(n_shards):
        _write(out / f"pretrain-{i:05d}.parquet", kept[i::n_shards])
    pq.write_table(pa.Table.from_pylist(quarantine, schema=QUARANTINE_SCHEMA), out / "quarantine.parquet",
                   compression="zstd")
    split_counts, task_ids = {}, []
    for d in domains:
        env = environments.get(d)
        train = env.generate("train", w.n_train, cfg.seed, **knobs)
        n_sft = int(len(train) * 0.75)
        sets = {"sft": train[:n_sft], "rl": train[n_sft:], "val": env.generate("val", w.n_val, cfg.seed, **knobs),
                "test": tests[d]}
        task_ids += [{"task_id": t.id, "set": f"{name}-{d}"} for name, ts in sets.items() for t in ts]
        for name, tasks in sets.items():
            _write(out / f"{name}-{d}.parquet", [{"id": t.id, "task": t.to_json()} for t in tasks])
            split_counts[f"{name}_{d}"] = len(tasks)
    validation.append(gates.validate("splits", pd.DataFrame(task_ids), gates.split_expectations()))
    (out / "validation.json").write_text(json.dumps(validation, indent=1))
    card = {"rows_in": n_in, "empty_files": empty_files, "rows_kept": len(kept), "rejected": dict(reasons), "pii_scrubbed": dict(pii_hits),
            "sources": dict(Counter(r["source"] for r in kept)), "splits": split_counts,
            "chars_kept": sum(len(r["text"]) for r in kept)}
    (out / "data_card.json").write_text(json.dumps(card, indent=1))
    metrics = {"rows_in": n_in, "rows_kept": len(kept), "empty_files": empty_files, **{f"rejected_{k}": v for k, v in reasons.items()},
               **{f"pii_{k.strip('<>').lower()}": v for k, v in pii_hits.items()}}
    return {"metrics": metrics, "datasets": [("raw", inputs["raw"])]}


def load_tasks(folder: str | Path, name: str, domain: str) -> list:
    from environments.base import Task
    table = pq.read_table(Path(folder) / f"{name}-{domain}.parquet")
    return [Task.from_json(s) for s in table.column("task").to_pylist()]


def load_pretrain_texts(folder: str | Path) -> list[str]:
    return [t for p in sorted(Path(folder).glob("pretrain-*.parquet")) for t in pq.read_table(p).column("text").to_pylist()]
