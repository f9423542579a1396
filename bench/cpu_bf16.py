"""bench/cpu_bf16: training tokens/s of a SmolLM2-135M-shaped Llama on CPU, fp32 against `runtime.cpu_bf16` (bf16
autocast over fp32 weights, as `posttrain.device.autocast` runs a training forward), side by side in one process.

The peer is the same training step in fp32, the embedded default's precision: forward + backward + fused AdamW on
the same random batch, alternating the two modes `REPEATS` times after a warm-up step each. The model is built from
SmolLM2-135M-Instruct's config (random weights: speed does not depend on the values), so no checkpoint is needed.
Autocast pays only where the CPU has bf16 instructions (AVX512-BF16, AMX); the JSON records the CPU's flags.

    python -m bench.cpu_bf16     (make bench B=cpu_bf16)

BENCH_SMALL=1: a 2-layer model of the same width at 2 x 64 tokens, one repeat.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from bench import mark, out_dir, size, threads
from posttrain.device import CPU_BF16, autocast
from posttrain.engines.optim import make_optimizer

# SmolLM2-135M-Instruct's shapes (its config.json after `posttrain checkpoint smollm2-135m-instruct`)
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=size(30, 2),
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
BATCHES = size([(8, 128), (4, 512)], [(2, 64)])
REPEATS = size(3, 1)


def _step(model, opt, ids: torch.Tensor, bf16: bool) -> float:
    os.environ[CPU_BF16] = "1" if bf16 else "0"
    t = time.perf_counter()
    with autocast(torch.device("cpu")):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def cpu_flags() -> list[str]:
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if "bf16" in f or f.startswith("amx"))


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    torch.set_num_threads(threads(2))
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    opt = make_optimizer(model, 1e-5)
    rows = []
    for b, t in BATCHES:
        ids = torch.randint(0, SHAPE["vocab_size"], (b, t))
        secs = {"fp32": [], "bf16": []}
        for mode in secs:  # warm-up: allocator, kernels' first call
            _step(model, opt, ids, mode == "bf16")
        for _ in range(REPEATS):
            for mode in secs:
                secs[mode].append(_step(model, opt, ids, mode == "bf16"))
        tps = {m: round(b * t / min(v), 1) for m, v in secs.items()}
        rows.append({"batch": b, "seq_len": t, "tokens_per_s_fp32": tps["fp32"], "tokens_per_s_bf16": tps["bf16"],
                     "speedup_bf16_vs_fp32": round(tps["bf16"] / tps["fp32"], 3)})
        print(f"bench/cpu_bf16: {b} x {t}: fp32 {tps['fp32']} tok/s, bf16 autocast {tps['bf16']} tok/s "
              f"({rows[-1]['speedup_bf16_vs_fp32']}x)", flush=True)
    os.environ.pop(CPU_BF16, None)
    fig = mark({"model": "SmolLM2-135M-Instruct's shapes, random weights", "layers": SHAPE["num_hidden_layers"],
                "threads": torch.get_num_threads(), "repeats": REPEATS, "best_of": "min seconds per mode",
                "peer": "the same step in fp32 (the embedded default), alternating in one process",
                "cpu": platform.processor() or platform.machine(), "cpu_bf16_flags": cpu_flags(),
                "torch": torch.__version__, "rows": rows,
                "speedup_bf16_vs_fp32": min(r["speedup_bf16_vs_fp32"] for r in rows)})
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_bf16.json").write_text(json.dumps(fig, indent=1))
    print(f"bench/cpu_bf16: wrote {out / 'cpu_bf16.json'}")


if __name__ == "__main__":
    main()
