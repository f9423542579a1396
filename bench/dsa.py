"""bench/dsa: DeepSeek Sparse Attention against dense attention.

`attention`: forward time and peak RSS of one attention layer against sequence length, dense (torch sdpa, causal)
against DSA (the lightning indexer's top-k, then attention over the selected keys), each point in its own process.
DSA's sparse part is O(L * top_k); its indexer is O(L^2) with a few heads, so both are timed.

`evidence`: the tiny profile's ramp per seed, dense against DSA adopted at the first stage longer than top_k (dense
warm-up of the indexers, then sparse training), with one indexer per layer and with IndexShare 4 (the first layer
alone, the other three sharing one indexer); long_context accuracy at the top length for each. The dense ramp's
stages before the adoption are shared (the DSA ramps resume from its scratch checkpoints), so each variant differs
only where DSA is on.

`evidence_glm5`: the same on GLM-5's architecture (the tiny profile's world, base and model; one ramp rung of
256 tokens, the profile's first): dense against DSA adopted through the model's own indexers (`models.glm5.install_dsa`:
the dense warm-up trains them, then sparse training at top-k 64 with their KL).

    python -m bench.dsa [attention|evidence|evidence_glm5] [--seeds 0 1]     (make bench B=dsa: all three)

BENCH_SMALL=1 (bench/__init__.py): `attention` at 256 and 512 tokens with top_k 64, one timed repeat, each point in
this process; `evidence` on the smoke profile (ramp stages of 96 and 128 tokens; DSA's top_k 100, adopted at 128,
after 4 indexer warm-up steps) from the smoke run's curated data and base model, seed 0; `attention_gpu` (CUDA
only) at 4k and 8k tokens.
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

from bench import children_in_process, mark, out_dir, size, small, smoke_stages, threads

OUT = out_dir()
WORK = OUT / "dsa-work"
SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROFILE = size("tiny-dense", "smoke-dense")
SEQ_LENS = size([1024, 2048, 4096, 8192, 16384], [256, 512])
SHAPE = dict(heads=8, kv_heads=2, head_dim=64, indexer_heads=4, top_k=size(512, 64))
TOP_K = size(256, 100)  # tiny: a quarter of the top length, 1024; smoke: between its two stages (96, 128)
_DSA = ["ramp.attention=dsa", f"ramp.dsa.top_k={TOP_K}", *size([], ["ramp.dsa.warmup_steps=4"])]
VARIANTS = {"dense": [], "dsa": _DSA,
            "dsa_indexshare": [*_DSA, "ramp.dsa.index_share=4",
                               "ramp.dsa.own_indexer=[0]"]}
REPEATS = size(3, 1)
# the profile's first rung alone (its 512-token rung takes 3x as long a step on this CPU)
GLM5_SETS = ["ramp.stages=[{seq_len: 256, tokens: 2048000, lr: 2.0e-3, rope_theta: 20000.0, long_share: 0.75}]"]
# the whole dsa section replaced: tiny's adopts at 512 with 50 warm-up steps, a rung this bench does not have
GLM5_VARIANTS = {"dense": ["ramp.attention=sdpa"], "dsa": ["ramp.attention=dsa", "ramp.dsa={top_k: 64}"]}


def _one(kind: str, seq_len: int) -> dict:
    import torch

    from kernels.dsa import indexer_topk, sparse_attention
    from posttrain.pipeline.memory import peak_memory
    torch.set_num_threads(threads(2))
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
    fig: dict = {"seq_lens": SEQ_LENS, **SHAPE, "device": f"cpu ({threads(2)} threads)", "repeats": REPEATS}
    for kind in ("dense", "dsa"):
        for key in ("seconds", "indexer_seconds", "peak_rss_mb"):
            fig[f"{kind}_{key}"] = []
        for L in SEQ_LENS:
            if children_in_process():
                res = _one(kind, L)
            else:
                p = subprocess.run([sys.executable, "-m", "bench.dsa", "_one", kind, str(L)], capture_output=True,
                                   text=True)
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


GPU_SEQ_LENS = size([4096, 8192, 16384, 32768, 65536, 131072], [4096, 8192])
# GLM-5's top 2048 keys; 32 query heads over 4 key heads of 128, bf16
GPU_SHAPE = dict(heads=32, kv_heads=4, head_dim=128, indexer_heads=4, top_k=2048)
GPU_BUDGET_S = 8.0  # a kind whose next length would take longer is skipped there (recorded as null)


def _cuda_seconds(fn, reps: int = 3) -> tuple[float, float]:
    """(median seconds, peak MB allocated above what was live before) of fn() on the GPU, after a warm-up."""
    import torch
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    live = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return round(sorted(times)[len(times) // 2], 5), round((torch.cuda.max_memory_allocated() - live) / 2 ** 20, 1)


def _gpu_point(L: int, s: dict, over: set[str]):
    """Yields (kind, (seconds, peak MB) or None, error or None) at length L; kinds in `over` are skipped."""
    import torch

    from kernels.dsa import indexer_topk, sparse_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(1, s["heads"], L, s["head_dim"], **bf)
    k, v = (torch.randn(1, s["kv_heads"], L, s["head_dim"], **bf) for _ in range(2))
    qi = torch.randn(1, L, s["indexer_heads"], s["head_dim"], **bf)
    w = torch.randn(1, L, s["indexer_heads"], **bf)
    go = torch.randn_like(q)
    # the peer at its best: flash attention, the key heads expanded outside the timing (flash has no GQA here)
    ke, ve = (t.repeat_interleave(s["heads"] // s["kv_heads"], 1) for t in (k, v))
    dense_leaf = [t.detach().requires_grad_() for t in (q, ke, ve)]
    leaf = [t.detach().requires_grad_() for t in (q, k, v)]
    idx = None

    def sdpa(*t):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)

    def index():
        nonlocal idx
        idx = indexer_topk(qi, w, k.mean(1), None, s["top_k"])
    calls = {"dense_fwd": lambda: sdpa(q, ke, ve), "dense_fwd_bwd": lambda: sdpa(*dense_leaf).backward(go),
             "dsa_indexer": index,
             "dsa_sparse_fwd": lambda: sparse_attention(q, k, v, idx, s["head_dim"] ** -0.5),
             "dsa_sparse_fwd_bwd": lambda: sparse_attention(*leaf, idx, s["head_dim"] ** -0.5).backward(go)}
    for kind, fn in calls.items():
        if kind in over or (idx is None and kind.startswith("dsa_sparse")):
            yield kind, None, None
            continue
        try:
            with torch.enable_grad() if kind.endswith("bwd") else torch.no_grad():
                yield kind, _cuda_seconds(fn), None
        except Exception as e:  # recorded, not fatal: the other kinds still report
            yield kind, None, f"{type(e).__name__}: {str(e)[:300]}"
        for t in leaf + dense_leaf:
            t.grad = None


def attention_gpu() -> dict:
    """One attention layer on the GPU, bf16: dense (torch sdpa: flash attention, causal) against DSA (the
    indexer's scores kernel + top-k, then the sparse attention kernels), forward and forward + backward, per
    length. Each length runs in its own process under a time limit; a kind that failed, ran out of time or would
    pass the budget at the next length is skipped from there (null)."""
    import torch
    s = GPU_SHAPE
    fig: dict = {"seq_lens": GPU_SEQ_LENS, **s, "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "budget_s": GPU_BUDGET_S,
                 "peer": "torch sdpa, SDPBackend.FLASH_ATTENTION, is_causal=True, bf16, key heads expanded untimed"}
    kinds = ("dense_fwd", "dense_fwd_bwd", "dsa_indexer", "dsa_sparse_fwd", "dsa_sparse_fwd_bwd")
    for kind in kinds:
        fig[f"{kind}_seconds"], fig[f"{kind}_peak_mb"] = [], []
    over: set[str] = set()
    for L in GPU_SEQ_LENS:
        cmd = [sys.executable, "-m", "bench.dsa", "_gpu", str(L), json.dumps(sorted(over))]
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=12 * GPU_BUDGET_S).stdout
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            fig.setdefault("errors", {})[f"@{L}"] = f"timed out after {12 * GPU_BUDGET_S:.0f} s"
        done = {}
        for line in text.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                done[r["kind"]] = r
        for kind in kinds:
            r = done.get(kind, {"res": None, "error": None if kind in over else "did not finish"})
            res = r["res"] or (None, None)
            if r["error"]:
                fig.setdefault("errors", {})[f"{kind}@{L}"] = r["error"]
            if res[0] is None or res[0] > GPU_BUDGET_S / 4:  # the next length: about 4x (L^2)
                over.add(kind)
            fig[f"{kind}_seconds"].append(res[0])
            fig[f"{kind}_peak_mb"].append(res[1])
        print(f"seq_len {L:7d} " + " ".join(f"{kd} {fig[kd + '_seconds'][-1]}" for kd in kinds), flush=True)

    def ratio(a: str, b: str) -> float | None:
        x, y = fig[a][-1], fig[b][-1]
        return None if x is None or y is None else round(x / y, 3)
    dsa_fwd = [None if a is None or b is None else round(a + b, 5)
               for a, b in zip(fig["dsa_indexer_seconds"], fig["dsa_sparse_fwd_seconds"])]
    fig["dsa_fwd_seconds"] = dsa_fwd
    fig["attn_time_ratio_at_top_len"] = ratio("dsa_fwd_seconds", "dense_fwd_seconds")
    fig["sparse_fwd_bwd_ratio_at_top_len"] = ratio("dsa_sparse_fwd_bwd_seconds", "dense_fwd_bwd_seconds")
    _plot_gpu(fig, OUT / "dsa_gpu.png")
    return fig


def _plot_gpu(fig: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = fig["seq_lens"]
    f, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("dense_fwd", "dense forward (sdpa)", "-"),
                              ("dsa_fwd", "DSA forward (indexer + sparse)", "-"),
                              ("dsa_indexer", "DSA indexer top-k", ":"),
                              ("dsa_sparse_fwd", "DSA sparse attention", "--"),
                              ("dense_fwd_bwd", "dense forward + backward", "-"),
                              ("dsa_sparse_fwd_bwd", "DSA sparse forward + backward", "--")):
        pts = [(x, y) for x, y in zip(xs, fig[f"{key}_seconds"]) if y is not None]
        if pts:
            a.plot(*zip(*pts), marker="o", ls=style, label=label)
    for key, label in (("dense_fwd", "dense forward"), ("dsa_indexer", "DSA indexer"),
                       ("dsa_sparse_fwd", "DSA sparse")):
        pts = [(x, y) for x, y in zip(xs, fig[f"{key}_peak_mb"]) if y is not None]
        if pts:
            b.plot(*zip(*pts), marker="o", label=label)
    for ax, label in ((a, "seconds (one layer)"), (b, "peak MB above the inputs")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    f.suptitle(f"{fig['heads']} heads ({fig['kv_heads']} kv) x {fig['head_dim']}, top_k {fig['top_k']}, "
               f"indexer {fig['indexer_heads']} heads, bf16; {fig['device']}")
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=100)
    plt.close(f)


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


def tiny_inputs(seed: int, profile: str = "tiny-dense", work: Path = WORK, base_sets: list[str] | None = None,
                tag: str = "") -> tuple[Path, Path]:
    """`profile`'s curated data and its base model for `seed` (with `base_sets`, the base under its own `tag`),
    made once under `work` (bench/mtp too). Small mode: the smoke run's (bench/__init__.py), its base model trained
    again for another seed."""
    from posttrain.stages import base
    from posttrain.config import load_config
    from posttrain.stages.curate import make_raw
    from posttrain.stages.curate import run as curate
    if small():
        art = smoke_stages()
        cur = Path(art["curate"])
        if seed == load_config(PROFILE).seed:
            return cur, Path(art["base"])
        b = WORK / f"base-{seed}"
        if not (b / "done").exists():
            base.run(load_config(PROFILE, [f"seed={seed}"]), {"curate": str(cur)}, b)
            (b / "done").touch()
        return cur, b
    cfg = load_config(profile)
    raw, cur = work / "raw", work / "curate"
    if not (cur / "done").exists():
        shutil.rmtree(work, ignore_errors=True)
        make_raw(cfg, {}, raw)
        curate(cfg, {"raw": str(raw)}, cur)
        (cur / "done").touch()
    b = work / (f"base-{seed}-{tag}" if base_sets else f"base-{seed}")
    if not (b / "done").exists():
        base.run(load_config(profile, [f"seed={seed}", *(base_sets or [])]), {"curate": str(cur)}, b)
        (b / "done").touch()
    return cur, b


def _ramp_result(cfg, cur: Path, base: Path, out: Path, scratch: Path | None = None) -> dict:
    """The ramp on `base`'s model: its numeric metrics and seconds, also written to `out`/result.json."""
    from posttrain.stages import ramp
    t = time.time()
    res = ramp.run(cfg, {"base": str(base), "curate": str(cur)}, out, scratch=str(scratch or ""))
    m = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
    m["seconds"] = round(time.time() - t, 1)
    (out / "result.json").write_text(json.dumps(m, indent=1))
    return m


def evidence(seeds: list[int]) -> dict:
    from posttrain.config import load_config
    top = load_config(PROFILE).ramp.stages[-1].seq_len
    runs: dict[str, dict[int, dict]] = {v: {} for v in VARIANTS}
    for seed in seeds:
        cur, b = tiny_inputs(seed)
        for name, sets in VARIANTS.items():
            vcfg = load_config(PROFILE, [f"seed={seed}", *sets])
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
            m = runs[name][seed] = _ramp_result(vcfg, cur, b, out, scratch)
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
        start = load_config(PROFILE, VARIANTS[name]).ramp.dsa_start()  # the warm-up ran at the adopting stage
        for key, at in (("indexer_kl_last", top), ("topk_recall_last", top), ("dsa_warmup.indexer_kl_first", start),
                        ("dsa_warmup.indexer_kl_last", start)):
            fig[f"{name}.{key}@{at}"] = [runs[name][s][f"ramp@{at}.{key}"] for s in seeds]
    fig["ramp_seconds"] = {name: [runs[name][s]["seconds"] for s in seeds] for name in VARIANTS}
    return fig


def evidence_glm5(seeds: list[int]) -> dict:
    """Dense against DSA through GLM-5's own indexers, per seed from the same curated data and base model."""
    if small():  # the small size's inputs are the smoke run's dense model
        raise SystemExit("bench.dsa evidence_glm5: no small size (it needs the tiny (GLM-5) world and base model)")
    from posttrain.config import load_config
    work = OUT / "dsa-glm5-work"
    top = load_config("tiny", GLM5_SETS).ramp.stages[-1].seq_len
    runs: dict[str, dict[int, dict]] = {v: {} for v in GLM5_VARIANTS}
    for seed in seeds:
        cur, b = tiny_inputs(seed, "tiny", work)
        for name, sets in GLM5_VARIANTS.items():
            out = work / f"ramp-{seed}-{name}"
            if (out / "result.json").exists():
                runs[name][seed] = json.loads((out / "result.json").read_text())
                continue
            shutil.rmtree(out, ignore_errors=True)
            m = runs[name][seed] = _ramp_result(load_config("tiny", [f"seed={seed}", *GLM5_SETS, *sets]),
                                                cur, b, out)
            print(f"glm5 seed {seed} {name}: long_context@{top} {m[f'ramp@{top}.long_context@{top}']} "
                  f"({m['seconds']} s)", flush=True)
    fig = {"profile": "tiny", "sets": GLM5_SETS, "variants": GLM5_VARIANTS, "seq_len": top, "seeds": seeds}
    for name in GLM5_VARIANTS:
        for key in (f"long_context@{top}", "short_val_loss", "loss_last"):
            xs = [runs[name][s][f"ramp@{top}.{key}"] for s in seeds]
            fig[f"{key}_{name}"] = round(mean(xs), 4)
            fig[f"{key}_{name}_std"] = round(stdev(xs), 4) if len(xs) > 1 else None
            fig[f"{key}_{name}_per_seed"] = xs
        fig[f"seconds_{name}"] = [runs[name][s]["seconds"] for s in seeds]
    for key in ("dsa_warmup.indexer_kl_first", "dsa_warmup.indexer_kl_last",
                "indexer_kl_first", "indexer_kl_last", "topk_recall_first", "topk_recall_last"):
        fig[f"dsa.{key}"] = [round(runs["dsa"][s][f"ramp@{top}.{key}"], 4) for s in seeds]
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.dsa")
    ap.add_argument("part", nargs="?", choices=["attention", "attention_gpu", "evidence", "evidence_glm5", "all"],
                    default="all")
    ap.add_argument("--seeds", type=int, nargs="+", default=size([0, 1], [0]))
    args = ap.parse_args(argv if argv is not None else [])
    path = OUT / "dsa.json"
    fig = json.loads(path.read_text()) if path.exists() else {}
    if args.part in ("evidence", "all"):
        fig.update(evidence(args.seeds))
    if args.part == "evidence_glm5" or (args.part == "all" and not small()):  # no smoke-sized GLM-5 ramp to learn
        fig["glm5"] = evidence_glm5(args.seeds)
    if args.part in ("attention", "all"):
        fig["attention"] = attention()
        fig["attn_time_ratio_at_top_len"] = fig["attention"]["attn_time_ratio_at_top_len"]
        import torch
        if torch.cuda.is_available():
            fig["attention_gpu"] = attention_gpu()
            fig["attn_time_ratio_at_top_len_gpu"] = fig["attention_gpu"]["attn_time_ratio_at_top_len"]
    if args.part == "attention_gpu":
        fig["attention_gpu"] = attention_gpu()
        fig["attn_time_ratio_at_top_len_gpu"] = fig["attention_gpu"]["attn_time_ratio_at_top_len"]
    fig = mark(fig)
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        print(json.dumps(_one(sys.argv[2], int(sys.argv[3]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "_gpu":  # one length of attention_gpu, a line per kind
        for kind, res, error in _gpu_point(int(sys.argv[2]), GPU_SHAPE, set(json.loads(sys.argv[3]))):
            print(json.dumps({"kind": kind, "res": res, "error": error}), flush=True)
    else:
        main(sys.argv[1:])
