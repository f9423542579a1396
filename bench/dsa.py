"""bench/dsa: DeepSeek Sparse Attention against dense attention.

`attention`: forward time and peak RSS of one attention layer against sequence length, dense (torch sdpa, causal)
against DSA (the lightning indexer's top-k, then attention over the selected keys), each point in its own process.
DSA's sparse part is O(L * top_k); its indexer is O(L^2) with a few heads, so both are timed.

`evidence`: the tiny profile's ramp per seed, dense against DSA adopted at the first stage longer than top_k (dense
warm-up of the indexers, then sparse training), with one indexer per layer and with IndexShare 4 (the first layer
alone, the other three sharing one indexer); long_context accuracy at the top length for each. The dense ramp's
stages before the adoption are shared (the DSA ramps resume from its scratch checkpoints), so each variant differs
only where DSA is on.

    python -m bench.dsa [attention|evidence] [--seeds 0 1]     (make bench B=dsa: both)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, stdev

OUT = Path(".posttrain/bench")
WORK = OUT / "dsa-work"
SEQ_LENS = [1024, 2048, 4096, 8192, 16384]
SHAPE = dict(heads=8, kv_heads=2, head_dim=64, indexer_heads=4, top_k=512)
TOP_K = 256  # tiny: a quarter of the top length, 1024
VARIANTS = {"dense": [], "dsa": ["ramp.attention=dsa", f"ramp.dsa.top_k={TOP_K}"],
            "dsa_indexshare": ["ramp.attention=dsa", f"ramp.dsa.top_k={TOP_K}", "ramp.dsa.index_share=4",
                               "ramp.dsa.own_indexer=[0]"]}
REPEATS = 3


def _one(kind: str, seq_len: int) -> dict:
    import torch

    from kernels.dsa import indexer_topk, sparse_attention
    from posttrain.memory import peak_memory
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    s = SHAPE
    q = torch.randn(1, s["heads"], seq_len, s["head_dim"], generator=g)
    k, v = (torch.randn(1, s["kv_heads"], seq_len, s["head_dim"], generator=g) for _ in range(2))
    qi = torch.randn(1, seq_len, s["indexer_heads"], s["head_dim"], generator=g)
    w = torch.randn(1, seq_len, s["indexer_heads"], generator=g)
    times = {"total": [], "indexer": []}
    with torch.no_grad(), peak_memory() as peak:
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            if kind == "dense":
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                t1 = time.perf_counter()
            else:
                idx = indexer_topk(qi, w, k.mean(1), None, s["top_k"])
                t1 = time.perf_counter()
                sparse_attention(q, k, v, idx, s["head_dim"] ** -0.5)
            times["total"].append(time.perf_counter() - t0)
            times["indexer"].append(t1 - t0 if kind != "dense" else 0.0)
    return {"seconds": round(min(times["total"][1:]), 4), "indexer_seconds": round(min(times["indexer"][1:]), 4),
            "peak_rss_mb": peak["mb"]}


def attention() -> dict:
    fig: dict = {"seq_lens": SEQ_LENS, **SHAPE, "device": "cpu (2 cores)", "repeats": REPEATS}
    for kind in ("dense", "dsa"):
        for key in ("seconds", "indexer_seconds", "peak_rss_mb"):
            fig[f"{kind}_{key}"] = []
        for L in SEQ_LENS:
            p = subprocess.run([sys.executable, "-m", "bench.dsa", "_one", kind, str(L)], capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(f"bench.dsa {kind} {L} failed:\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"seq_len {L:6d} {kind:6s} {res}", flush=True)
            for key, val in res.items():
                fig[f"{kind}_{key}"].append(val)
    fig["attn_time_ratio_at_top_len"] = round(fig["dsa_seconds"][-1] / fig["dense_seconds"][-1], 3)
    fig["attn_memory_ratio_at_top_len"] = round(fig["dsa_peak_rss_mb"][-1] / fig["dense_peak_rss_mb"][-1], 3)
    _plot(fig, OUT / "dsa.png")
    return fig


def _plot(fig: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = fig["seq_lens"]
    f, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(xs, fig["dense_seconds"], marker="o", label="dense (sdpa, causal)")
    a.plot(xs, fig["dsa_seconds"], marker="o", label=f"DSA, top_k {fig['top_k']} (indexer + sparse)")
    a.plot(xs, [t - i for t, i in zip(fig["dsa_seconds"], fig["dsa_indexer_seconds"])], marker="o", ls="--",
           label="DSA: sparse attention alone")
    b.plot(xs, fig["dense_peak_rss_mb"], marker="o", label="dense")
    b.plot(xs, fig["dsa_peak_rss_mb"], marker="o", label="DSA")
    for ax, label in ((a, "forward seconds (one layer)"), (b, "peak RSS (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.set_yscale("log")
    f.suptitle(f"{fig['heads']} heads ({fig['kv_heads']} kv) x {fig['head_dim']}, indexer {fig['indexer_heads']} heads; "
               f"{fig['device']}")
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=100)
    plt.close(f)


def tiny_inputs(seed: int) -> tuple[Path, Path]:
    """The tiny profile's curated data and its base model for `seed`, made once under WORK (bench/mtp too)."""
    from posttrain import base
    from posttrain.config import load_config
    from posttrain.curate.stage import make_raw
    from posttrain.curate.stage import run as curate
    cfg = load_config("tiny")
    raw, cur = WORK / "raw", WORK / "curate"
    if not (cur / "done").exists():
        shutil.rmtree(WORK, ignore_errors=True)
        make_raw(cfg, {}, raw)
        curate(cfg, {"raw": str(raw)}, cur)
        (cur / "done").touch()
    b = WORK / f"base-{seed}"
    if not (b / "done").exists():
        base.run(load_config("tiny", [f"seed={seed}"]), {"curate": str(cur)}, b)
        (b / "done").touch()
    return cur, b


def evidence(seeds: list[int]) -> dict:
    from posttrain import ramp
    from posttrain.config import load_config
    top = load_config("tiny").ramp.stages[-1].seq_len
    runs: dict[str, dict[int, dict]] = {v: {} for v in VARIANTS}
    for seed in seeds:
        cur, b = tiny_inputs(seed)
        for name, sets in VARIANTS.items():
            vcfg = load_config("tiny", [f"seed={seed}", *sets])
            out, scratch = WORK / f"ramp-{seed}-{name}", WORK / f"scratch-{seed}-{name}"
            if (out / "result.json").exists():
                runs[name][seed] = json.loads((out / "result.json").read_text())
                continue
            shutil.rmtree(out, ignore_errors=True)
            if name != "dense":  # the dense stages before DSA's adoption, as the dense ramp trained them
                for st in vcfg.ramp.stages:
                    if st.seq_len < vcfg.ramp.dsa_start():
                        shutil.copytree(WORK / f"scratch-{seed}-dense" / "stages" / str(st.seq_len),
                                        scratch / "stages" / str(st.seq_len), dirs_exist_ok=True)
            t = time.time()
            res = ramp.run(vcfg, {"base": str(b), "curate": str(cur)}, out, scratch=str(scratch))
            m = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
            m["seconds"] = round(time.time() - t, 1)
            (out / "result.json").write_text(json.dumps(m, indent=1))
            runs[name][seed] = m
            print(f"seed {seed} {name}: long_context@{top} {m[f'ramp@{top}.long_context@{top}']} "
                  f"({m['seconds']} s)", flush=True)

    def acc(name: str) -> list[float]:
        return [runs[name][s][f"ramp@{top}.long_context@{top}"] for s in seeds]

    fig = {"seq_len": top, "top_k": TOP_K, "seeds": seeds, "index_share": 4, "own_indexer": [0]}
    for key, name in (("dense", "dense"), ("dsa", "dsa"), ("dsa_indexshare", "dsa_indexshare")):
        xs = acc(name)
        fig[f"long_context_top_{key}"] = round(mean(xs), 4)
        fig[f"long_context_top_{key}_per_seed"] = xs
        fig[f"long_context_top_{key}_std"] = round(stdev(xs), 4) if len(xs) > 1 else None
    for name in ("dsa", "dsa_indexshare"):
        fig[f"{name}_minus_dense_per_seed"] = [round(a - b, 4) for a, b in zip(acc(name), acc("dense"))]
        start = load_config("tiny", VARIANTS[name]).ramp.dsa_start()  # the warm-up ran at the adopting stage
        for key, at in (("indexer_kl_last", top), ("topk_recall_last", top), ("dsa_warmup.indexer_kl_first", start),
                        ("dsa_warmup.indexer_kl_last", start)):
            fig[f"{name}.{key}@{at}"] = [runs[name][s][f"ramp@{at}.{key}"] for s in seeds]
    fig["ramp_seconds"] = {name: [runs[name][s]["seconds"] for s in seeds] for name in VARIANTS}
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.dsa")
    ap.add_argument("part", nargs="?", choices=["attention", "evidence", "all"], default="all")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv if argv is not None else [])
    path = OUT / "dsa.json"
    fig = json.loads(path.read_text()) if path.exists() else {}
    if args.part in ("evidence", "all"):
        fig.update(evidence(args.seeds))
    if args.part in ("attention", "all"):
        fig["attention"] = attention()
        fig["attn_time_ratio_at_top_len"] = fig["attention"]["attn_time_ratio_at_top_len"]
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        print(json.dumps(_one(sys.argv[2], int(sys.argv[3]))))
    else:
        main(sys.argv[1:])
