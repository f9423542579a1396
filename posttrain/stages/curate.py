"""curate: normalise, quality-filter, decontaminate, dedup (exact + MinHash LSH), scrub PII, split.

Three passes, memory bounded by the batch size, not the corpus:
1. scan (one Ray task per input file): parse, normalise, quality rules, test-item matching; survivors go
   to a candidates Parquet and their keys (exact hash, MinHash signature, LSH band keys) to flat files.
2. dedup (driver): sort the key files to find exact and near duplicates across all files.
3. write (one Ray task per file): kept rows to pretrain shards, duplicates to quarantine, output gate.
Accounting is exact: rows in = rows kept + rows rejected by reason; every rejected row is in
quarantine.parquet with its reason.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import environments
from posttrain.config import PipelineConfig
from posttrain.curate import gates
from posttrain.curate.corpus import generate_raw
from posttrain.curate.dedup import (MinHasher, WordHashes, contains_windows, flat_ids, global_dedup, hash64,
                                    sorted_member, target_windows, tokenize, window_hashes)
from posttrain.curate.read import BLANK, EMPTY, BadRow, check_inputs, data_files, read_rows
from posttrain.curate.text import normalise, quality, scrub_pii
from posttrain.pipeline.raysupport import map_tasks

__all__ = ["BadRow", "make_raw", "run"]
QUARANTINE_SCHEMA = pa.schema([(k, pa.string()) for k in ("id", "text", "reason", "detail", "source")])
CANDIDATE_SCHEMA = pa.schema([("gidx", pa.uint64()), ("id", pa.string()), ("text", pa.string()),
                              ("source", pa.string()), ("tokens", pa.int64()), ("pii", pa.string())])
PRETRAIN_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
                             ("weight", pa.float64())])
BATCH = 2048
GATE_CHUNK = 50_000
ROW_BITS = 40  # gidx = file index << 40 | row number: one integer that sorts in input order


def make_raw(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    """The raw corpus artifact: the user's files copied in, or the generated default corpus."""
    c = cfg.curate
    if c.inputs:
        files = check_inputs(c.inputs, c.text_field)
        for f in files:
            shutil.copy(f, out / Path(f).name)
        return {"metrics": {"files": len(files)}}
    planted = generate_raw(out, c.raw_docs, cfg.world.seed, cfg.world)
    (out / "planted.json").write_text(json.dumps(planted, indent=1))
    return {"metrics": {f"planted_{k}": v for k, v in planted.items()}}


def _quarantine_row(rid: str, text: str, reason: str, detail: str, source: str) -> dict:
    if len(text) > 10_000:
        detail = f"{detail}; text truncated from {len(text)} chars".lstrip("; ")
        text = text[:10_000]
    return {"id": rid, "text": text, "reason": reason, "detail": detail, "source": source}


def _test_items(cfg: PipelineConfig) -> dict[str, list]:
    w = cfg.world
    return {d: environments.get(d).generate("test", w.n_test, cfg.world.seed, **w.knobs(d))
            for d in environments.names(w.environments)}


def scan_file(cfg: PipelineConfig, path: Path, index: int, work: Path, targets: dict) -> dict:
    """Pass 1 over one input file (see the module docstring); returns its counts."""
    c = cfg.curate
    work.mkdir(parents=True)
    hasher = MinHasher(c.num_perm, c.near_dup_threshold, cfg.world.seed)
    words = WordHashes()
    keys = {"gidx": open(work / "gidx.bin", "wb"), "exact": open(work / "exact.bin", "wb"),
            "sigs": open(work / "sigs.bin", "wb"),
            **{b: open(work / f"band{b:03d}.bin", "wb") for b in range(hasher.bands)}}
    candidates = pq.ParquetWriter(work / "candidates.parquet", CANDIDATE_SCHEMA, compression="zstd")
    quarantine = pq.ParquetWriter(work / "quarantine-scan.parquet", QUARANTINE_SCHEMA, compression="zstd")
    stats = {"rows_in": 0, "empty_files": 0, "blank_lines": 0, "mojibake_repaired": 0, "rejected": Counter(),
             "validation": []}
    no_text: dict[str, list] = {}  # problem: [first row, rows] of the rows without text, for a failed input gate
    rejected_rows: list[dict] = []
    batch: list[tuple] = []
    gate_rows: list[tuple] = []

    def reject(rid, text, reason, detail, source):
        stats["rejected"][(reason, source)] += 1
        rejected_rows.append(_quarantine_row(rid, text, reason, detail, source))
        if len(rejected_rows) >= BATCH:
            quarantine.write_table(pa.Table.from_pylist(rejected_rows, schema=QUARANTINE_SCHEMA))
            rejected_rows.clear()

    def flush():
        if not batch:
            return
        flat, offsets = flat_ids([b[4] for b in batch], words)
        dirty = contains_windows(flat, offsets, targets)
        shingles, doc = window_hashes(flat, offsets, c.shingle_size, short=True)
        sig = hasher.signatures(shingles, doc, len(batch))
        keep = np.flatnonzero(~dirty)
        for i in np.flatnonzero(dirty):
            gidx, rid, text, source, _ = batch[i]
            reject(rid, text, "contamination", "contains an evaluation test item", source)
        rows = []
        for i in keep:
            gidx, rid, text, source, toks = batch[i]
            text, hits = scrub_pii(text)
            rows.append({"gidx": gidx, "id": rid, "text": text, "source": source, "tokens": len(toks),
                         "pii": json.dumps(hits) if hits else ""})
        candidates.write_table(pa.Table.from_pylist(rows, schema=CANDIDATE_SCHEMA))
        np.array([batch[i][0] for i in keep], np.uint64).tofile(keys["gidx"])
        np.array([hash64(batch[i][2]) for i in keep], np.uint64).tofile(keys["exact"])
        sig[keep].tofile(keys["sigs"])
        bands = hasher.band_keys(sig[keep])
        for b in range(hasher.bands):
            np.ascontiguousarray(bands[:, b]).tofile(keys[b])
        batch.clear()

    def gate():
        if gate_rows:
            df = pd.DataFrame(gate_rows, columns=["id", "text", "source"])
            try:
                stats["validation"].append(gates.validate(f"input {path.name}", df, gates.input_expectations()))
            except gates.GateFailed as e:  # the rule alone does not say what the rows hold instead
                if not no_text:
                    raise
                why = "; ".join(f"{first}{f' and {n - 1} more rows' if n > 1 else ''}: {problem}"
                                for problem, (first, n) in no_text.items())
                raise gates.GateFailed(f"{e}\n  rows without a string {c.text_field!r}: {why} (set curate.text_field "
                                       f"to the field that holds the text)") from None
            gate_rows.clear()

    try:
        for line, row, problem in read_rows(path, c.text_field):
            where = f"{path.name}:{line}"
            if problem == BLANK:  # not a row
                stats["blank_lines"] += 1
                continue
            if problem == EMPTY:
                blank = stats["blank_lines"]
                why = f"no rows, only {blank} blank line{'s' * (blank != 1)}" if blank else "the file is empty"
                if c.on_bad_row == "fail":
                    raise BadRow(f"{path.name}: {why} (set curate.on_bad_row=quarantine to skip it)")
                stats["empty_files"] += 1
                rejected_rows.append(_quarantine_row(where, "", "empty_file", why, "unknown"))
                continue
            stats["rows_in"] += 1
            text = row.get(c.text_field) if row is not None and not problem else None
            rid = str(row.get(c.id_field, where)) if row is not None else where
            source = str((row or {}).get(c.source_field, "unknown"))
            gate_rows.append((rid, text, source))
            if len(gate_rows) >= GATE_CHUNK:
                gate()
            if problem:
                if problem in no_text or len(no_text) < 3:
                    no_text.setdefault(problem, [where, 0])[1] += 1
                if c.on_bad_row == "fail":
                    raise BadRow(f"{where}: {problem} (set curate.on_bad_row=quarantine to keep going)")
                reject(where, "", "bad_row", problem, source)
                continue
            if len(text) > c.max_chars:  # before any per-character work: a 50 MB line costs nothing more
                reject(rid, text, "too_long", f"{len(text)} chars", source)
                continue
            text, repaired = normalise(text)
            stats["mojibake_repaired"] += repaired
            toks = tokenize(text)
            reason = quality(text, toks, c)
            if reason:
                reject(rid, text, reason, "", source)
                continue
            batch.append(((index << ROW_BITS) | line, rid, text, source, toks))
            if len(batch) >= BATCH:
                flush()
        flush()
        gate()
        if rejected_rows:
            quarantine.write_table(pa.Table.from_pylist(rejected_rows, schema=QUARANTINE_SCHEMA))
    finally:
        candidates.close()
        quarantine.close()
        for f in keys.values():
            f.close()
    return stats


def write_file(cfg: PipelineConfig, index: int, work: Path, out: Path, removed: np.ndarray, reasons: list[str],
               details: list[str], targets: dict) -> dict:
    """Pass 3 over one file's candidates: kept rows to a pretrain shard, duplicates to quarantine."""
    c = cfg.curate
    words = WordHashes()
    stats = {"kept": Counter(), "tokens": Counter(), "pii": Counter(), "rejected": Counter(), "validation": []}
    pretrain = pq.ParquetWriter(out / f"pretrain-{index:05d}.parquet", PRETRAIN_SCHEMA, compression="zstd")
    quarantine = pq.ParquetWriter(work / "quarantine-dedup.parquet", QUARANTINE_SCHEMA, compression="zstd")
    ids = open(work / "idhash.bin", "wb")
    gate_frames: list[pd.DataFrame] = []
    try:
        for batch in pq.ParquetFile(work / "candidates.parquet").iter_batches(batch_size=BATCH):
            df = batch.to_pandas()
            is_dup, pos = sorted_member(removed, df["gidx"].to_numpy())
            dups = [_quarantine_row(r.id, r.text, reasons[p], details[p], r.source)
                    for r, p in zip(df[is_dup].itertuples(), pos[is_dup])]
            for d in dups:
                stats["rejected"][(d["reason"], d["source"])] += 1
            if dups:
                quarantine.write_table(pa.Table.from_pylist(dups, schema=QUARANTINE_SCHEMA))
            kept = df[~is_dup]
            for source, toks in zip(kept["source"], kept["tokens"]):
                stats["kept"][source] += 1
                stats["tokens"][source] += int(toks)
            for hits in kept["pii"]:
                if hits:
                    stats["pii"].update(json.loads(hits))
            weights = [c.mixture.get(s, 1.0) for s in kept["source"]]
            pretrain.write_table(pa.table({"id": kept["id"], "text": kept["text"], "source": kept["source"],
                                           "weight": weights}, schema=PRETRAIN_SCHEMA))
            np.array([hash64(i) for i in kept["id"]], np.uint64).tofile(ids)
            texts = kept["text"].tolist()
            flat, offsets = flat_ids([tokenize(t) for t in texts], words)
            gate_frames.append(pd.DataFrame({"id": kept["id"], "text": texts,
                                             "contaminated": contains_windows(flat, offsets, targets)}))
            if sum(map(len, gate_frames)) >= GATE_CHUNK:
                stats["validation"].append(_output_gate(gate_frames, c, work))
        if gate_frames:
            stats["validation"].append(_output_gate(gate_frames, c, work))
    finally:
        pretrain.close()
        quarantine.close()
        ids.close()
    return stats


def _output_gate(frames: list[pd.DataFrame], c, work: Path) -> dict:
    df = pd.concat(frames, ignore_index=True)
    frames.clear()
    return gates.validate(f"output {work.name}", df, gates.output_expectations(c.min_chars, c.max_chars))


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    c = cfg.curate
    files = data_files(Path(inputs["raw"]))
    if not files:
        raise BadRow(f"{inputs['raw']}: no .jsonl, .jsonl.gz or .parquet file to curate")
    if len(files) >= 1 << (64 - ROW_BITS):
        raise BadRow(f"{inputs['raw']}: {len(files)} files; merge them below {1 << (64 - ROW_BITS)}")
    tests = _test_items(cfg)
    targets = target_windows([t.fingerprint() for ts in tests.values() for t in ts])
    work = out / ".work"
    shards = [work / f"file-{i:05d}" for i in range(len(files))]
    scans = map_tasks(scan_file, [(cfg, f, i, s, targets) for i, (f, s) in enumerate(zip(files, shards))], "curate scan")
    if not sum(s["rows_in"] for s in scans):
        raise BadRow(f"{inputs['raw']}: no rows in {', '.join(f.name for f in files)} (every file is empty)")
    bands = MinHasher(c.num_perm, c.near_dup_threshold, cfg.world.seed).bands
    removed, reason, dup_of = global_dedup(shards, bands, c.num_perm, c.near_dup_threshold)
    file_of = (removed >> np.uint64(ROW_BITS)).astype(np.int64)
    calls = []
    for i, s in enumerate(shards):
        sel = file_of == i
        details = [f"duplicate of {files[int(g) >> ROW_BITS].name}:{int(g) & ((1 << ROW_BITS) - 1)}"
                   for g in dup_of[sel]]
        calls.append((cfg, i, s, out, removed[sel], [("exact_dup", "near_dup")[r] for r in reason[sel]], details,
                      targets))
    writes = map_tasks(write_file, calls, "curate write")

    rejected = sum((s["rejected"] for s in scans + writes), Counter())
    kept = sum((s["kept"] for s in writes), Counter())
    n_in = sum(s["rows_in"] for s in scans)
    if n_in != sum(kept.values()) + sum(rejected.values()):
        raise AssertionError(f"curate accounting broken: {n_in} rows in != {sum(kept.values())} kept + "
                             f"{sum(rejected.values())} rejected")
    if not kept:
        raise ValueError("curate kept no rows: every input row was rejected (see quarantine reasons)")
    validation = [v for s in scans for v in s["validation"]] + [v for s in writes for v in s["validation"]]
    validation.append(_global_id_gate(shards, out))
    _merge_parquet([p for s in shards for p in (s / "quarantine-scan.parquet", s / "quarantine-dedup.parquet")],
                   out / "quarantine.parquet")
    split_counts = _write_splits(cfg, tests, out, validation)
    shutil.rmtree(work)
    (out / "validation.json").write_text(json.dumps(validation, indent=1))

    reasons = Counter()
    for (r, _), n in rejected.items():
        reasons[r] += n
    pii = sum((s["pii"] for s in writes), Counter())
    tokens = sum((s["tokens"] for s in writes), Counter())
    by_source: dict[str, dict] = {}
    for (r, src), n in rejected.items():
        by_source.setdefault(src, {}).setdefault("rejected", {})[r] = n
    for src in kept:
        weight = c.mixture.get(src, 1.0)
        by_source.setdefault(src, {}).update(kept=kept[src], tokens=tokens[src], mixture_weight=weight,
                                             pretrain_tokens_weighted=round(tokens[src] * weight))
    empty = sum(s["empty_files"] for s in scans)
    card = {"rows_in": n_in, "rows_kept": sum(kept.values()), "empty_files": empty,
            "blank_lines_skipped": sum(s["blank_lines"] for s in scans), "rejected": dict(reasons),
            "sources": by_source, "tokens_kept": sum(tokens.values()), "token_unit": "regex word/punct tokens",
            "mojibake_repaired": sum(s["mojibake_repaired"] for s in scans), "pii_scrubbed": dict(pii),
            "splits": split_counts, "files": [f.name for f in files],
            "near_dup": {"shingle_size": c.shingle_size, "threshold": c.near_dup_threshold, "num_perm": c.num_perm,
                         "bands": bands}}
    (out / "data_card.json").write_text(json.dumps(card, indent=1))
    metrics = {"rows_in": n_in, "rows_kept": card["rows_kept"], "empty_files": empty, "tokens_kept": card["tokens_kept"],
               "mojibake_repaired": card["mojibake_repaired"], **{f"rejected_{k}": v for k, v in reasons.items()},
               **{f"pii_{k.strip('<>').lower()}": v for k, v in pii.items()}}
    out_rows = {"metrics": metrics, "datasets": [("raw", inputs["raw"])]}
    if reasons:  # the user's own rows left out: say how many and where, not only in the data card
        why = ", ".join(f"{n} {r}" for r, n in reasons.most_common())
        out_rows["notices"] = [f"quarantined {sum(reasons.values())} of {n_in} rows ({why}): rows and reasons in "
                               f"{{artifact}}/quarantine.parquet, counts in {{artifact}}/data_card.json"]
    return out_rows


def _global_id_gate(shards: list[Path], out: Path) -> dict:
    """Ids unique across files, checked on 8-byte hashes (bounded memory); a failure names the ids."""
    id_hashes = np.concatenate([np.fromfile(s / "idhash.bin", np.uint64) for s in shards])
    try:
        return gates.validate("output ids", pd.DataFrame({"id_hash": id_hashes}), gates.global_id_expectations())
    except gates.GateFailed:
        uniq, counts = np.unique(id_hashes, return_counts=True)
        dup = set(uniq[counts > 1].tolist())
        names = sorted({i for p in sorted(out.glob("pretrain-*.parquet"))
                        for i in pq.read_table(p, columns=["id"]).column("id").to_pylist() if hash64(i) in dup})
        raise gates.GateFailed(f"curate gate 'output ids' failed: {len(dup)} ids occur in more than one row or "
                               f"file, e.g. {names[:5]} (set curate.id_field to a unique field)") from None


def _merge_parquet(parts: list[Path], dest: Path) -> None:
    """Concatenate Parquet files row group by row group (bounded memory)."""
    with pq.ParquetWriter(dest, QUARANTINE_SCHEMA, compression="zstd") as writer:
        for p in parts:
            f = pq.ParquetFile(p)
            for i in range(f.num_row_groups):
                writer.write_table(f.read_row_group(i))


def _write_splits(cfg: PipelineConfig, tests: dict[str, list], out: Path, validation: list) -> dict:
    """SFT set, RL prompt pools, validation and test sets per domain, from the environments."""
    w = cfg.world
    counts, task_ids = {}, []
    for d, test in tests.items():
        env = environments.get(d)
        train = env.generate("train", w.n_train, cfg.world.seed, **w.knobs(d))
        n_sft = int(len(train) * 0.75)
        sets = {"sft": train[:n_sft], "rl": train[n_sft:], "val": env.generate("val", w.n_val, cfg.world.seed, **w.knobs(d)),
                "test": test}
        task_ids += [{"task_id": t.id, "set": f"{name}-{d}"} for name, ts in sets.items() for t in ts]
        for name, tasks in sets.items():
            pq.write_table(pa.Table.from_pylist([{"id": t.id, "task": t.to_json()} for t in tasks]),
                           out / f"{name}-{d}.parquet", compression="zstd")
            counts[f"{name}_{d}"] = len(tasks)
    validation.append(gates.validate("splits", pd.DataFrame(task_ids), gates.split_expectations()))
    return counts
