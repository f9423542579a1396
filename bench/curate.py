"""bench/curate: our curate against datatrove's MinHash dedup on the same generated corpus and machine.

Both run in child processes (ours with its Ray workers, datatrove with its worker pool) while this
process samples the whole process tree's RSS. Same shingle size and band layout for both; datatrove
uses its default (fastest) hashing and text normalisation, except that numbers are kept as they are,
as ours does (its default maps every digit to 0, which makes worked examples that differ only in their
numbers identical). Near-duplicate recall and precision are measured against the planted ground truth:
a planted pair is found when exactly one of the two documents is dropped; a drop is correct when the
document has a planted twin that survives. Precision counts drops among documents whose ground truth
speaks to duplication; the planted junk kinds (symbol noise, "buy X now" spam, cookie banners, quoted
test items) are templated and near duplicates of one another by design, and our quality rules drop
them before dedup.

BENCH_SMALL=1 (bench/__init__.py): 2,000 documents, the "10x" corpus 1x and not run again (its figures are the 1x
run's: the same code on the same size); datatrove's side only where it is installed.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import mark, out_dir, peer, size

DOCS = int(os.environ.get("BENCH_CURATE_DOCS", size(200_000, 2_000)))
SCALE = size(10, 1)  # the larger corpus: this many corpora side by side (the `10x` figures)
OUT = out_dir()
DATA = OUT / f"curate-data-{DOCS}"
# the bench world: operands large enough for 200k distinct worked examples
OVERRIDES = [f"curate.raw_docs={DOCS}", "world.max_operand=999", "world.n_ops=3"]


def _cfg():
    from posttrain.config import load_config
    return load_config("tiny-dense", OVERRIDES)


def _corpus(name: str, seeds: range) -> Path:
    """One folder of JSONL.gz files: the corpora of `seeds` side by side (generated once, then reused)."""
    from posttrain.curate.corpus import generate_raw
    folder = DATA / name
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _cfg()
    for seed in seeds:
        src = DATA / f"seed{seed}"
        if not (src / "planted.json").exists():
            planted = generate_raw(src, DOCS, seed, cfg.world)
            (src / "planted.json").write_text(json.dumps(planted))
        for f in sorted(src.glob("*.jsonl.gz")):
            link = folder / f"s{seed}-{f.name}"
            if not link.exists():
                link.symlink_to(f.resolve())
    (folder / "done").touch()
    return folder


def _tree_rss(pid: int) -> int:
    import psutil
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue  # exited between listing and reading: it holds no memory now
    return total


def _measure(*args: str) -> dict:
    """Run `python -m bench.curate <args>` and return its JSON result plus the tree's peak RSS."""
    p = subprocess.Popen([sys.executable, "-m", "bench.curate", *args], stdout=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while p.poll() is None:
            peak[0] = max(peak[0], _tree_rss(p.pid))
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = p.communicate()
    t.join()
    if p.returncode:
        raise RuntimeError(f"bench.curate {' '.join(args)} failed with exit code {p.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = round(peak[0] / 2**20)
    return result


def _ours(data: str, out: str) -> None:
    import shutil

    from posttrain.stages import curate
    from posttrain.pipeline.raysupport import ensure_ray
    cfg = _cfg()
    ensure_ray(cfg.runtime)
    shutil.rmtree(out, ignore_errors=True)
    Path(out).mkdir(parents=True)
    t = time.perf_counter()
    metrics = curate.run(cfg, {"raw": data}, Path(out))["metrics"]
    print(json.dumps({"seconds": time.perf_counter() - t, "rows_in": metrics["rows_in"]}))


def _datatrove(data: str, out: str) -> None:
    import shutil

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster, \
        MinhashDedupFilter, MinhashDedupSignature
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.text import TextNormConfig

    from posttrain.curate.dedup import MinHasher
    c = _cfg().curate
    hasher = MinHasher(c.num_perm, c.near_dup_threshold, 0)
    bands, rows = hasher.bands, hasher.rows
    shutil.rmtree(out, ignore_errors=True)
    files = len(list(Path(data).glob("*.jsonl.gz")))
    mc = MinhashConfig(n_grams=c.shingle_size, num_buckets=bands, hashes_per_bucket=rows,
                       norm_config=TextNormConfig(norm_numbers=False))
    logs = f"{out}/logs"
    s1 = LocalPipelineExecutor([JsonlReader(data, glob_pattern="*.jsonl.gz"),
                                MinhashDedupSignature(f"{out}/sigs", config=mc)],
                               tasks=files, workers=2, logging_dir=f"{logs}/1")
    s2 = LocalPipelineExecutor([MinhashDedupBuckets(f"{out}/sigs", f"{out}/buckets", config=mc)],
                               tasks=bands, workers=2, logging_dir=f"{logs}/2", depends=s1)
    s3 = LocalPipelineExecutor([MinhashDedupCluster(f"{out}/buckets", f"{out}/remove", config=mc)],
                               tasks=1, logging_dir=f"{logs}/3", depends=s2)
    s4 = LocalPipelineExecutor([JsonlReader(data, glob_pattern="*.jsonl.gz"),
                                MinhashDedupFilter(f"{out}/remove", exclusion_writer=JsonlWriter(f"{out}/removed")),
                                JsonlWriter(f"{out}/kept")], tasks=files, workers=2, logging_dir=f"{logs}/4", depends=s3)
    t = time.perf_counter()
    s4.run()
    print(json.dumps({"seconds": time.perf_counter() - t}))


JUNK = ("junk", "repetitive", "boilerplate", "contamination")


def _planted(data: Path) -> dict[str, dict]:
    docs = {}
    for f in sorted(data.glob("*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            for line in fh:
                d = json.loads(line)
                docs[d["id"]] = d["meta"]
    return docs


def _score(meta: dict[str, dict], dropped: set[str]) -> tuple[float, float]:
    """(recall on planted near-duplicate pairs, precision of the drops) as in the module docstring."""
    twins: dict[str, set[str]] = {}
    for i, m in meta.items():
        if "dup_of" in m:
            twins.setdefault(i, set()).add(m["dup_of"])
            twins.setdefault(m["dup_of"], set()).add(i)
    pairs = [(i, m["dup_of"]) for i, m in meta.items() if m["planted"] == "near_dup"]
    recall = sum((a in dropped) != (b in dropped) for a, b in pairs) / len(pairs)
    judged = [i for i in dropped if meta[i]["planted"] not in JUNK]
    right = sum(any(t not in dropped for t in twins.get(i, ())) for i in judged)
    return recall, right / max(len(judged), 1)


def main() -> None:
    import pyarrow.parquet as pq
    one = _corpus("1x", range(1))
    ten = _corpus("10x", range(SCALE)) if SCALE > 1 else one
    meta = _planted(one)
    print(f"corpus: {len(meta)} docs; running ours (1x) ...", flush=True)
    ours = _measure("_ours", str(one), str(DATA / "out-ours"))
    q = pq.read_table(DATA / "out-ours" / "quarantine.parquet", columns=["id", "reason"]).to_pylist()
    near = {r["id"] for r in q if r["reason"] == "near_dup"}
    dropped_ours = near | {r["id"] for r in q if r["reason"] == "exact_dup"}
    contaminated = {i for i, m in meta.items() if m["planted"] == "contamination"}
    removed_contaminated = {r["id"] for r in q if r["reason"] == "contamination"} & contaminated
    dt, dropped_dt = None, set()
    if peer("datatrove", "curate"):
        print("running datatrove (1x) ...", flush=True)
        dt = _measure("_datatrove", str(one), str(DATA / "out-datatrove"))
        for f in (DATA / "out-datatrove" / "removed").glob("*.jsonl*"):
            with (gzip.open(f, "rt") if f.name.endswith(".gz") else open(f)) as fh:
                dropped_dt |= {json.loads(line)["id"] for line in fh}
    if SCALE > 1:
        print(f"running ours ({SCALE}x) ...", flush=True)
        ours10 = _measure("_ours", str(ten), str(DATA / "out-ours-10x"))
    else:
        ours10 = ours
    recall, _ = _score(meta, dropped_ours)
    _, precision = _score(meta, near)
    recall_dt, precision_dt = _score(meta, dropped_dt) if dt else (None, None)
    docs = len(meta)

    def r(x, n):
        return None if x is None else round(x, n)
    fig = {
        "docs": docs, "docs_per_s": round(docs / ours["seconds"], 1),
        "docs_per_s_datatrove": r(docs / dt["seconds"], 1) if dt else None,
        "throughput_ratio_vs_datatrove": r(dt["seconds"] / ours["seconds"], 3) if dt else None,
        "near_dup_recall": round(recall, 4), "near_dup_precision": round(precision, 4),
        "near_dup_recall_datatrove": r(recall_dt, 4), "near_dup_precision_datatrove": r(precision_dt, 4),
        "contaminated_planted": len(contaminated), "contaminated_removed": len(removed_contaminated),
        "peak_rss_mb_1x": ours["peak_rss_mb"], "peak_rss_mb_10x": ours10["peak_rss_mb"],
        "peak_rss_ratio_10x_vs_1x": round(ours10["peak_rss_mb"] / ours["peak_rss_mb"], 3),
        "peak_rss_mb_datatrove": dt["peak_rss_mb"] if dt else None, "docs_10x": ours10["rows_in"],
        "docs_per_s_10x": round(ours10["rows_in"] / ours10["seconds"], 1),
        "seconds": round(ours["seconds"], 1), "seconds_datatrove": r(dt["seconds"], 1) if dt else None,
        "near_dup_dropped": len(near), "dropped_datatrove": len(dropped_dt),
    }
    fig = mark({**fig, "scale": SCALE})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "curate.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_ours", "_datatrove"):
        {"_ours": _ours, "_datatrove": _datatrove}[sys.argv[1]](*sys.argv[2:])
    else:
        main()
