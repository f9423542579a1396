"""bench/kernels: each Triton kernel against its plain-torch reference and its peer on a GPU, in one run:

- log-probability forward + backward at 16k tokens, hidden 4096, vocab 152k, bf16: the full logits (torch), our
  any-loss form (`linear_logprob`: the backward recomputes the logits), our gradient-in-forward forms (SFT's
  `linear_weighted_logprob_loss`, one row kernel a chunk: the `logprob_*_vs_liger` keys; the RL step's
  `linear_logprob_loss`, any per-token loss: `logprob_token_loss_speed_ratio_vs_liger`) and Liger-Kernel's fused
  linear cross-entropy, all on the mean NLL; time (median of REPS after a warm-up) and peak memory above the
  inputs;
- the full-vocabulary reverse KL at 4k tokens, the same three ways of ours against torch;
- the W4A8 GEMM at 4096 -> 14336 against the bf16 matmul at 1..256 rows, each timed by Triton's `do_bench` and
  inside a CUDA graph (`do_bench_cudagraph`, how a serving engine runs a decode step: launches cost nothing);
  the launch is swept first in stages (layout and form, tiles, K step and depth; split-K deterministic only;
  configurations that fail or are off the reference skipped) and the best per row count is timed beside the
  shipped defaults;
- the grouped expert GEMM (a GLM-5 gate projection: 256 experts, 6144 -> 2048, top 8) at 16 and 512 tokens
  against the loop over experts (our dense kernel per expert) and against torch's bf16 grouped matmul.

`--defaults`: no sweep (the shipped tiles and row-kernel launch, timed); `--profile`: each log-probability side's
kernels by GPU time.

Without a GPU it records the interpreter's correctness (`kernels.selfcheck` under TRITON_INTERPRET=1) and
null GPU figures, saying so. `python -m bench.kernels --dry` runs the GPU figures' code at tiny shapes on CPU
under the interpreter (a check of the benchmark itself; its numbers mean nothing).

BENCH_SMALL=1 (bench/__init__.py): on a GPU the figures at the dry run's shapes (REPS 1); without one, the
interpreter's check and then the dry run in a child process (TRITON_INTERPRET=1), its figures under `dry`. Liger's
row only where Liger-Kernel is installed."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from bench import mark, out_dir, peer, size, small

OUT = out_dir()
REPS = size(5, 1)
FULL = {"tokens": 16384, "hidden": 4096, "vocab": 152064, "kl_tokens": 4096, "w4a8_k": 4096, "w4a8_n": 14336,
        "batches": [1, 4, 16, 64, 256], "group": 128,
        "moe": {"experts": 256, "top_k": 8, "k": 6144, "n": 2048, "tokens": [16, 512]}}
DRY = {"tokens": 64, "hidden": 32, "vocab": 500, "kl_tokens": 32, "w4a8_k": 64, "w4a8_n": 48,
       "batches": [1, 16], "group": 32, "moe": {"experts": 4, "top_k": 2, "k": 64, "n": 48, "tokens": [3, 9]}}
# the W4A8 sweep, in stages (deterministic configurations only: split-K adds fixed-order partial sums): every
# layout and form at the default tiles, then the best one's tiles, then its K step and pipeline depth
FORMS = [{"layout": "nk"}, {"layout": "planes"}] + [{"layout": "bytes", "swap": swap, "asm": asm, "BK": 128}
                                                   for swap in (False, True) for asm in (False, True)]
TILES = {"BN": [64, 128, 256], "SPLIT_K": [4, 8, 16], "num_warps": [4, 8]}
DEPTH = {"BK": [64, 128], "num_stages": [2, 3, 4]}
DEFAULTS_ONLY = "--defaults" in sys.argv  # no sweep: the shipped default tiles, timed
ROW_SWEEP = [{"BLOCK": 4096, "num_warps": 8}, {"BLOCK": 8192, "num_warps": 16}, {"BLOCK": 16384, "num_warps": 16},
             {"BLOCK": 32768, "num_warps": 32}]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(fn, device: str, reps: int = REPS) -> tuple[float, float | None]:
    """(median seconds, peak MB allocated above what was live before) of fn()."""
    fn()  # warm-up: compilation, autotuning, allocator
    _sync(device)
    peak = None
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return statistics.median(times), peak


def _fast(fn, device: str, graph: bool = False, rep: int = 100) -> float:
    """Median seconds of a short call: Triton's event timing on a GPU (in a CUDA graph where `graph`), the wall
    clock elsewhere."""
    if device != "cuda":
        return _measure(fn, device, reps=3)[0]
    import triton.testing
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") / 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") / 1e3


def _ratio(a, b):
    return None if a is None or b is None or not b else round(a / b, 3)


def _logprob_figures(device: str, s: dict, dtype: torch.dtype, g: torch.Generator) -> dict:
    from kernels import logprob
    from kernels.logprob import (default_chunk, linear_logprob, linear_logprob_loss, linear_logprob_reference,
                                 linear_weighted_logprob_loss)
    from kernels.reverse_kl import linear_reverse_kl, linear_reverse_kl_loss, linear_reverse_kl_reference
    n, d, v = s["tokens"], s["hidden"], s["vocab"]
    h = (torch.randn(n, d, device=device, generator=g, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(v, d, device=device, generator=g, dtype=dtype) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), device=device, generator=g)
    rows_launch = None
    if device == "cuda" and not DEFAULTS_ONLY:  # the row kernels' block and warps, on one chunk of logits here
        from kernels.logprob import _grad_in_place, _stats, _stats_and_grad
        z = torch.randn(default_chunk(n, v, d), v, device=device, dtype=dtype)
        t = target[:z.size(0)]
        ones = torch.ones(z.size(0), device=device)
        timed = {}
        for cfg in ROW_SWEEP:
            logprob.ROW_LAUNCH = cfg

            def rows_step():
                logp, ent, lse = _stats(z, t, 1.0)
                _grad_in_place(z.clone(), t, lse, ent, ones, ones * 0, 1.0)
                _stats_and_grad(z.clone(), t, ones, ones * 0, 1.0)
            timed[json.dumps(cfg)] = _fast(rows_step, device)
        rows_launch = {"seconds": timed, "chosen": json.loads(min(timed, key=timed.get))}
        logprob.ROW_LAUNCH = rows_launch["chosen"]
        del z

    def step(loss_fn):
        def run():
            h.grad = w.grad = None
            loss_fn().backward()
        return run

    def nll(lp, ent, rows):
        return -lp.sum() / n
    mean = torch.full((n,), -1.0 / n, device=device)
    rows = {"torch": step(lambda: -linear_logprob_reference(h, w, target)[0].mean()),
            "fused": step(lambda: -linear_logprob(h, w, target)[0].mean()),
            # SFT's form: the NLL's coefficients known beforehand, one row kernel a chunk (as Liger's)
            "fused_nll": step(lambda: linear_weighted_logprob_loss(h, w, target, mean)[0]),
            # the RL step's form: any per-token loss, differentiated between two row kernels a chunk
            "fused_loss": step(lambda: linear_logprob_loss(h, w, target, nll)[0]),
            # twice the chunk (twice the logits at the peak): half the passes over the head's weight gradient
            "fused_nll_2x_chunk": step(lambda: linear_weighted_logprob_loss(
                h, w, target, mean, chunk_tokens=2 * default_chunk(n, v, d))[0])}
    if peer("liger_kernel", "kernels"):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        # Liger at its best for this comparison, set explicitly: the plain mean NLL our side computes, no extras
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                                                 reduction="mean", softcap=None, return_z_loss=False)
        rows["liger"] = step(lambda: liger(w, h, target))
    lp = {k: _measure(f, device) for k, f in rows.items()}
    if device == "cuda" and "--profile" in sys.argv:  # where each side's time goes, by kernel
        _profile({k: rows[k] for k in ("fused_nll", "fused_loss", "liger") if k in rows})
    m = s["kl_tokens"]
    hk = h[:m].detach().clone().requires_grad_()
    teacher = torch.log_softmax(torch.randn(m, v, device=device, generator=g), -1)

    def kl_step(fn):
        def run():
            hk.grad = w.grad = None
            fn().backward()
        return run
    kl = {"torch": _measure(kl_step(lambda: linear_reverse_kl_reference(hk, w, teacher).mean()), device),
          "fused": _measure(kl_step(lambda: linear_reverse_kl(hk, w, teacher).mean()), device),
          "fused_loss": _measure(kl_step(lambda: linear_reverse_kl_loss(hk, w, teacher,
                                                                         lambda k, r: k.sum() / m)[0]), device)}
    return {
        "logprob_peak_mem_ratio_vs_torch": _ratio(lp["fused_nll"][1], lp["torch"][1]),
        "logprob_peak_mem_ratio_vs_liger": _ratio(lp["fused_nll"][1], lp["liger"][1]) if "liger" in lp else None,
        "logprob_speed_ratio_vs_liger": _ratio(lp["liger"][0], lp["fused_nll"][0]) if "liger" in lp else None,
        "logprob_speed_ratio_vs_torch": _ratio(lp["torch"][0], lp["fused_nll"][0]),
        "logprob_token_loss_speed_ratio_vs_liger": _ratio(lp["liger"][0], lp["fused_loss"][0]) if "liger" in lp
        else None,
        "logprob_any_loss_speed_ratio_vs_liger": _ratio(lp["liger"][0], lp["fused"][0]) if "liger" in lp else None,
        "reverse_kl_peak_mem_ratio_vs_torch": _ratio(kl["fused_loss"][1], kl["torch"][1]),
        "reverse_kl_speed_ratio_vs_torch": _ratio(kl["torch"][0], kl["fused_loss"][0]),
        "logprob": {k: {"s": t, "peak_mb": p} for k, (t, p) in lp.items()},
        "reverse_kl": {k: {"s": t, "peak_mb": p} for k, (t, p) in kl.items()},
        "row_kernel_launch": rows_launch}


def _profile(steps: dict) -> None:
    from torch.profiler import ProfilerActivity, profile
    for name, fn in steps.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"bench/kernels profile {name}:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                                                             max_name_column_width=50), flush=True)


def _sweep(fn, want: torch.Tensor, device: str, base: dict, m: int, layouts,
           splits: list[int] | None = None) -> tuple[dict, dict]:
    """The fastest configuration of `fn(config)` in a CUDA graph, in stages (FORMS, TILES, DEPTH, then the
    activation quantization in the prologue): (best config, seconds or why not per tried config). A configuration
    that fails to compile or run, or whose output is off `want` by more than 1e-3 of its largest value, is recorded
    and skipped. `fn` gets the weights in the config's layout."""
    import itertools
    if device != "cuda" or DEFAULTS_ONLY:
        return dict(base), {}
    tried: dict[str, float | str] = {}

    def trial(cfg: dict) -> None:
        key = json.dumps(cfg, sort_keys=True)
        if key in tried or cfg["layout"] not in layouts:
            return
        try:
            err = ((fn(cfg) - want).abs().max() / want.abs().max()).item()
            tried[key] = _fast(lambda: fn(cfg), device, graph=True, rep=30) if err < 1e-3 else f"wrong: {err:.2g}"
        except Exception as e:  # noqa: BLE001 - a configuration this Triton or GPU cannot run
            tried[key] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"bench/kernels sweep rows {m}: {key} -> {tried[key]}", flush=True)

    def best() -> dict:
        timed = {k: v for k, v in tried.items() if isinstance(v, float)}
        return json.loads(min(timed, key=timed.get)) if timed else dict(base)
    for form in FORMS:
        trial({**base, "swap": False, "asm": False, **form})
    splits = splits or (TILES["SPLIT_K"] if m <= 16 else [1])
    for bm, bn, split, warps in itertools.product([base["BM"]] if m <= 16 else [32, 64], TILES["BN"], splits,
                                                  TILES["num_warps"]):
        trial({**best(), "BM": bm, "BN": bn, "SPLIT_K": split, "num_warps": warps})
    for bk, stages in itertools.product(DEPTH["BK"] if best()["layout"] == "bytes" else [best()["BK"]],
                                        DEPTH["num_stages"]):
        trial({**best(), "BK": bk, "num_stages": stages})
    trial({**best(), "fuse_quant": True})
    return best(), tried


def _w4a8_figures(device: str, s: dict, dtype: torch.dtype, g: torch.Generator) -> dict:
    from kernels.w4a8 import (LAYOUTS, default_config, kernel_layout, layout_for, pack_int4, quantize_activations,
                              w4a8_linear, w4a8_reference)
    k, cols, group = s["w4a8_k"], s["w4a8_n"], s["group"]
    q = torch.randint(-8, 8, (cols, k), dtype=torch.int8, device=device, generator=g)
    layouts = {name: kernel_layout(pack_int4(q), name) for name in {layout_for(k, group, lay) for lay in LAYOUTS}}
    scales = torch.rand(cols, k // group, device=device, generator=g) * 0.01
    w_bf16 = (q.float() * 0.01).to(dtype)
    out = {}
    for b in s["batches"]:
        x = torch.randn(b, k, device=device, dtype=dtype, generator=g)
        want = w4a8_reference(*quantize_activations(x), pack_int4(q), scales)  # float64 sums: exact
        best, tried = _sweep(lambda c: w4a8_linear(x, layouts[c["layout"]], scales, config=c), want, device,
                             default_config(b, k, group), b, layouts)
        packed = layouts[best["layout"]]
        row = {"config": best, "default_config": default_config(b, k, group)}
        for mode in ("graph", "plain"):
            graph = mode == "graph"
            t_bf16 = _fast(lambda: x @ w_bf16.t(), device, graph)
            t_best = _fast(lambda: w4a8_linear(x, packed, scales, config=best), device, graph)
            t_default = _fast(lambda: w4a8_linear(x, layouts[default_config(b, k, group)["layout"]], scales), device,
                              graph)
            row[mode] = {"bf16_s": t_bf16, "w4a8_s": t_best, "w4a8_default_s": t_default,
                         "speedup": _ratio(t_bf16, t_best), "speedup_default": _ratio(t_bf16, t_default)}
        first = w4a8_linear(x, packed, scales, config=best)
        row["deterministic"] = all(torch.equal(first, w4a8_linear(x, packed, scales, config=best)) for _ in range(5))
        row["max_rel_err"] = ((first - want).abs().max() / want.abs().max()).item()
        row["sweep"] = tried
        out[b] = row
        print(f"bench/kernels w4a8 rows {b}: {row['graph']}", flush=True)
    return out


def _moe_figures(device: str, s: dict, dtype: torch.dtype, g: torch.Generator) -> dict:
    """Routed experts at GLM-5's gate-projection shape: grouped (one launch) against the loop over experts and
    against torch's bf16 grouped matmul (or a bf16 loop where this torch has none)."""
    from kernels.w4a8 import (LAYOUTS, default_config, kernel_layout, layout_for, pack_int4, w4a8_grouped,
                              w4a8_grouped_reference, w4a8_linear)
    e, top, k, n = s["experts"], s["top_k"], s["k"], s["n"]
    group = s.get("group", 128) if k % 128 == 0 else 32
    shapes = {"nk": ((n, k // 8), torch.int32), "planes": ((k // 8, n), torch.int32), "bytes": ((n, k // 2), torch.int8)}
    layouts = {name: torch.empty(e, *shapes[name][0], dtype=shapes[name][1], device=device)
               for name in {layout_for(k, group, lay) for lay in LAYOUTS}}
    w_bf16 = torch.empty(e, n, k, dtype=dtype, device=device)
    for i in range(e):  # per expert: the packing's int64 intermediates of all experts at once would not fit
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device, generator=g)
        for name, packed in layouts.items():
            packed[i] = kernel_layout(pack_int4(q), name)
        w_bf16[i] = (q.float() * 0.01).to(dtype)
    scales = torch.rand(e, n, k // group, device=device, generator=g) * 0.01
    out = {}
    for tokens in s["tokens"]:
        logits = torch.randn(tokens, e, device=device, generator=g)
        experts = logits.topk(top, -1).indices.flatten()
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=e)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        x = torch.randn(tokens, k, device=device, dtype=dtype, generator=g)[order // top]  # rows sorted by expert
        bounds = offsets.tolist()
        used = [(i, bounds[i], bounds[i + 1]) for i in range(e) if bounds[i + 1] > bounds[i]]
        rows = x.size(0)
        want = w4a8_grouped_reference(x, offsets, layouts["nk"], scales)
        best, tried = _sweep(lambda c: w4a8_grouped(x, offsets, layouts[c["layout"]], scales, config=c), want, device,
                             default_config(max(1, rows // e), k, group, grouped=True), 16, layouts, splits=[1, 2])
        packed = layouts[best["layout"]]

        def loop():  # each expert at its own rows' default tiles, as IntLinear runs it
            return [w4a8_linear(x[a:b], layouts[default_config(b - a, k, group)["layout"]][i], scales[i])
                    for i, a, b in used]

        def loop_bf16():
            return [x[a:b] @ w_bf16[i].t() for i, a, b in used]
        bf16_name = "torch._grouped_mm"
        try:
            def grouped_bf16():
                return torch._grouped_mm(x, w_bf16.transpose(-2, -1), offs=offsets[1:].to(torch.int32))
            grouped_bf16()
        except Exception as err:  # noqa: BLE001 - no grouped bf16 matmul in this torch or on this device
            bf16_name, grouped_bf16 = f"loop of bf16 matmuls ({type(err).__name__}: {str(err)[:120]})", loop_bf16
        row = {"rows": rows, "experts_used": len(used), "config": best, "bf16_peer": bf16_name}
        for mode in ("graph", "plain"):
            graph = mode == "graph"
            row[mode] = {"grouped_s": _fast(lambda: w4a8_grouped(x, offsets, packed, scales, config=best), device, graph),
                         "loop_s": _fast(loop, device, graph), "bf16_grouped_s": _fast(grouped_bf16, device, graph)}
        want = torch.cat(loop())
        got = w4a8_grouped(x, offsets, packed, scales, config=best)
        row["max_abs_err_vs_loop"] = (got - want).abs().max().item()
        row["sweep"] = tried
        out[tokens] = row
        print(f"bench/kernels moe tokens {tokens}: {row['graph']}, config {best}", flush=True)
    return out


def gpu_figures(device: str, s: dict, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    fig = _logprob_figures(device, s, dtype, g)
    print(f"bench/kernels logprob: {fig['logprob']}\nbench/kernels reverse_kl: {fig['reverse_kl']}", flush=True)
    w4a8 = _w4a8_figures(device, s, dtype, g)
    moe = _moe_figures(device, s["moe"], dtype, g)
    big = max(s["moe"]["tokens"])
    few = [w4a8[b]["graph"]["speedup"] for b in s["batches"] if b <= 16]
    fig.update({
        "w4a8_speed_ratio_vs_bf16": min(few) if few and None not in few else None,
        **{f"w4a8_speed_ratio_vs_bf16_rows{b}": w4a8[b]["graph"]["speedup"] for b in (1, 16, 64) if b in w4a8},
        "w4a8_deterministic": all(r["deterministic"] for r in w4a8.values()),
        "w4a8_max_rel_err": max(r["max_rel_err"] for r in w4a8.values()),
        "moe_grouped_speed_ratio_vs_loop": _ratio(moe[big]["graph"]["loop_s"], moe[big]["graph"]["grouped_s"]),
        "moe_grouped_speed_ratio_vs_bf16": _ratio(moe[big]["graph"]["bf16_grouped_s"], moe[big]["graph"]["grouped_s"]),
        "w4a8": w4a8, "moe": moe, "shapes": s, "dtype": str(dtype).removeprefix("torch."), "reps": REPS,
        "timing": "logprob and reverse_kl: median wall time of synchronised calls (REPS after a warm-up); w4a8 and "
                  "moe: triton.testing.do_bench_cudagraph medians (ratios; CUDA graphs, as serving runs decode) and "
                  "do_bench medians ('plain', each launch from Python)",
        "peers": {"liger": "liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss(ignore_index=-100, "
                           "lse_square_scale=0, label_smoothing=0, reduction='mean', softcap=None, "
                           "return_z_loss=False): the mean NLL, as ours",
                  "torch": "log_softmax over the full logits", "bf16": "x @ W.T in bf16 (cuBLAS)",
                  "moe_loop": "our dense W4A8 kernel once per expert with rows"}})
    return fig


def main(argv: list[str] | None = None) -> None:
    from kernels.selfcheck import interpreted
    argv = sys.argv[1:] if argv is None else argv
    fig: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    try:
        # small mode's dry child: its parent ran the interpreter's check
        errors = {"triton": 1.0} if small() and "--dry" in argv else interpreted()
        errors.pop("triton")
        if errors:
            fig.update(interpret_max_abs_err=max(errors.values()), interpret_errors=errors)
    except RuntimeError as e:  # the GPU figures still mean something: the compiled kernels are checked there
        if not torch.cuda.is_available():
            raise
        fig["interpret_failed"] = str(e)[-500:]
    null = dict.fromkeys(["logprob_peak_mem_ratio_vs_torch", "logprob_peak_mem_ratio_vs_liger",
                          "logprob_speed_ratio_vs_liger", "logprob_token_loss_speed_ratio_vs_liger",
                          "reverse_kl_peak_mem_ratio_vs_torch",
                          "reverse_kl_speed_ratio_vs_torch", "w4a8_speed_ratio_vs_bf16",
                          "w4a8_speed_ratio_vs_bf16_rows1", "w4a8_speed_ratio_vs_bf16_rows16",
                          "w4a8_speed_ratio_vs_bf16_rows64", "moe_grouped_speed_ratio_vs_loop"])
    if torch.cuda.is_available():
        from kernels.selfcheck import check
        fig["device"] = torch.cuda.get_device_name()
        fig["cuda_errors"] = check("cuda")  # the compiled kernels against their references, small shapes
        fig.update(gpu_figures("cuda", DRY if small() else FULL, torch.bfloat16))
    elif "--dry" in argv:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry runs the Triton kernels on CPU: run it with TRITON_INTERPRET=1")
        fig.update(device="cpu (dry run under TRITON_INTERPRET=1: the figures mean nothing)",
                   **gpu_figures("cpu", DRY, torch.float32))
    else:
        fig.update(device=None, note="no GPU on this machine: GPU figures are null, not estimated", **null)
        if small():  # the GPU figures' code at the dry shapes, interpreted: the benchmark itself still runs
            p = subprocess.run([sys.executable, "-m", "bench.kernels", "--dry"], text=True, capture_output=True,
                               env={**os.environ, "TRITON_INTERPRET": "1"})
            if p.returncode:
                raise RuntimeError(f"bench.kernels --dry failed:\n{p.stderr[-3000:]}")
            print("".join(line + "\n" for line in p.stdout.splitlines() if line.startswith("bench/")), end="")
            fig["dry"] = json.loads((OUT / "kernels-dry.json").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    name = "kernels-dry.json" if "--dry" in argv and not torch.cuda.is_available() else "kernels.json"
    fig = mark(fig)
    (OUT / name).write_text(json.dumps(fig, indent=1))
    print(json.dumps({k: v for k, v in fig.items() if k not in ("w4a8", "moe")}, indent=1))
    print(summary(fig))


def summary(fig: dict) -> str:
    """The figures a reader looks for, one line each (the full JSON has the sweeps)."""
    lines = [f"bench/kernels on {fig.get('device')}"]
    for key in ("logprob", "reverse_kl"):
        for name, row in (fig.get(key) or {}).items():
            lines.append(f"  {key:10} {name:20} {row['s'] * 1e3:9.1f} ms  peak {row['peak_mb'] or 0:9.0f} MB")
    for b, row in (fig.get("w4a8") or {}).items():
        gr, pl = row["graph"], row["plain"]
        lines.append(f"  w4a8 rows {b:>4}: graph {gr['w4a8_s'] * 1e6:7.1f} us vs bf16 {gr['bf16_s'] * 1e6:7.1f} "
                     f"({gr['speedup']}x; default tiles {gr['speedup_default']}x), plain {pl['speedup']}x, "
                     f"{json.dumps({k: row['config'].get(k) for k in ('BM', 'BN', 'BK', 'SPLIT_K', 'num_warps', 'num_stages', 'layout', 'swap', 'asm', 'fuse_quant')})}")
    for t, row in (fig.get("moe") or {}).items():
        gr = row["graph"]
        lines.append(f"  moe tokens {t:>4} ({row['rows']} rows, {row['experts_used']} experts): grouped "
                     f"{gr['grouped_s'] * 1e6:8.1f} us, loop {gr['loop_s'] * 1e6:8.1f}, bf16 grouped "
                     f"{gr['bf16_grouped_s'] * 1e6:8.1f} ({row['bf16_peer'][:40]}), err {row['max_abs_err_vs_loop']:.2g}")
    lines += [f"  {k} = {v}" for k, v in fig.items() if "_ratio_" in k or k.startswith("w4a8_")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
