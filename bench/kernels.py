"""bench/kernels: each Triton kernel against its plain-torch reference, and the fused log-probability kernel
against Liger-Kernel's fused linear cross-entropy, forward + backward, time (median of REPS after a warm-up)
and peak memory above the inputs, at realistic shapes on a GPU: 16k tokens, hidden 4096, vocab 152k, bf16;
the W4A8 GEMM at 4096 -> 14336 against the bf16 matmul for batches 1..256.

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
        "batches": [1, 4, 16, 64, 256], "group": 128}
DRY = {"tokens": 64, "hidden": 32, "vocab": 500, "kl_tokens": 32, "w4a8_k": 64, "w4a8_n": 48,
       "batches": [1, 16], "group": 32}


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


def _ratio(a, b):
    return None if a is None or b is None or not b else round(a / b, 3)


def gpu_figures(device: str, s: dict, dtype: torch.dtype) -> dict:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from kernels.logprob import linear_logprob, linear_logprob_reference
    from kernels.reverse_kl import linear_reverse_kl, linear_reverse_kl_reference
    from kernels.w4a8 import quantize_activations_fused, w4a8_matmul
    g = torch.Generator(device=device).manual_seed(0)
    n, d, v = s["tokens"], s["hidden"], s["vocab"]
    h = (torch.randn(n, d, device=device, generator=g, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(v, d, device=device, generator=g, dtype=dtype) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), device=device, generator=g)

    def step(loss_fn):
        def run():
            h.grad = w.grad = None
            loss_fn().backward()
        return run
    rows = {"torch": step(lambda: -linear_logprob_reference(h, w, target)[0].mean()),
            "fused": step(lambda: -linear_logprob(h, w, target)[0].mean())}
    if peer("liger_kernel", "kernels"):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        # Liger at its best for this comparison, set explicitly: the plain mean NLL our side computes, no extras
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                                                 reduction="mean", softcap=None, return_z_loss=False)
        rows["liger"] = step(lambda: liger(w, h, target))
    logprob = {k: _measure(f, device) for k, f in rows.items()}
    m = s["kl_tokens"]
    hk = h[:m].detach().clone().requires_grad_()
    teacher = torch.log_softmax(torch.randn(m, v, device=device, generator=g), -1)

    def kl_step(fn):
        def run():
            hk.grad = w.grad = None
            fn(hk, w, teacher).mean().backward()
        return run
    kl = {"torch": _measure(kl_step(linear_reverse_kl_reference), device),
          "fused": _measure(kl_step(linear_reverse_kl), device)}
    k, cols, group = s["w4a8_k"], s["w4a8_n"], s["group"]
    q = torch.randint(-8, 8, (cols, k), dtype=torch.int8)
    packed = pack_to_int32(q, 4).to(device)
    scales = (torch.rand(cols, k // group) * 0.01).to(device)
    w_bf16 = (q.float() * 0.01).to(device, dtype)
    w4a8 = {}
    for b in s["batches"]:
        x = torch.randn(b, k, device=device, dtype=dtype)
        t_bf16, _ = _measure(lambda: x @ w_bf16.t(), device, reps=20)
        # the quantized layer's path (activations quantized in one launch, then the GEMM); the GEMM alone; and
        # split-K 8, faster at a few rows but not the default (its atomics make the sums' order vary)
        t_w4a8, _ = _measure(lambda: w4a8_matmul(*quantize_activations_fused(x), packed, scales), device, reps=20)
        xq, sx = quantize_activations_fused(x)
        t_gemm, _ = _measure(lambda: w4a8_matmul(xq, sx, packed, scales), device, reps=20)
        t_split, _ = _measure(lambda: w4a8_matmul(xq, sx, packed, scales, config={"SPLIT_K": 8}), device, reps=20)
        w4a8[b] = {"bf16_s": t_bf16, "w4a8_s": t_w4a8, "speedup": _ratio(t_bf16, t_w4a8), "gemm_s": t_gemm,
                   "gemm_split_k8_s": t_split}
    few = [w4a8[b]["speedup"] for b in s["batches"] if b <= 16]
    return {
        "logprob_peak_mem_ratio_vs_torch": _ratio(logprob["fused"][1], logprob["torch"][1]),
        "logprob_speed_ratio_vs_liger": _ratio(logprob["liger"][0], logprob["fused"][0])
        if "liger" in logprob else None,
        "logprob_speed_ratio_vs_torch": _ratio(logprob["torch"][0], logprob["fused"][0]),
        "reverse_kl_peak_mem_ratio_vs_torch": _ratio(kl["fused"][1], kl["torch"][1]),
        "reverse_kl_speed_ratio_vs_torch": _ratio(kl["torch"][0], kl["fused"][0]),
        "w4a8_speed_ratio_vs_bf16": min(few) if few and None not in few else None,
        "logprob": {k: {"s": t, "peak_mb": p} for k, (t, p) in logprob.items()},
        "reverse_kl": {k: {"s": t, "peak_mb": p} for k, (t, p) in kl.items()},
        "w4a8": w4a8, "shapes": s, "dtype": str(dtype).removeprefix("torch."), "reps": REPS,
        "peers": {"liger": "liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss(ignore_index=-100, "
                           "lse_square_scale=0, label_smoothing=0, reduction='mean', softcap=None, "
                           "return_z_loss=False): the mean NLL, as ours", "torch": "log_softmax over the full logits"}}


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
    null = dict.fromkeys(["logprob_peak_mem_ratio_vs_torch", "logprob_speed_ratio_vs_liger",
                          "reverse_kl_peak_mem_ratio_vs_torch", "w4a8_speed_ratio_vs_bf16"])
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
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    main()
