"""bench/cpu_bf16: training tokens/s of a SmolLM2-135M-shaped Llama on CPU, fp32 against `runtime.cpu_bf16` (bf16
autocast over fp32 weights, as `posttrain.device.autocast` runs a training forward), side by side in one process.

The peer is the same training step in fp32, the embedded default's precision: forward + backward + fused AdamW on
the same random batch, alternating the two modes `REPEATS` times after a warm-up step each. The model is built from
SmolLM2-135M-Instruct's config (random weights: speed does not depend on the values), so no checkpoint is needed.
Autocast pays only where the CPU has bf16 instructions (AVX512-BF16, AMX); the JSON records the CPU's flags.

    python -m bench.cpu_bf16     (make bench B=cpu_bf16)

The same for greedy decoding (`eval.dtype`, `rl.rollout_dtype`): `posttrain.engines.torch_rollout.sample` from the
model with fp32 weights against a bf16 copy (weights, activations and KV cache in bf16), `DECODE` prompts of 64
tokens, 32 new tokens each, one thread as each evaluate task runs; `decode_speedup_bf16_vs_fp32`.

BENCH_SMALL=1: a 2-layer model of the same width at 2 x 64 tokens, one repeat.
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch

from bench import mark, out_dir, size, threads
from posttrain.device import CPU_BF16, autocast, cpu_bf16_flags
from posttrain.engines.optim import make_optimizer

# SmolLM2-135M-Instruct's shapes (its config.json after `posttrain checkpoint smollm2-135m-instruct`)
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=size(30, 2),
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
BATCHES = size([(8, 128), (4, 512)], [(2, 64)])
REPEATS = size(3, 1)
DECODE = size(16, 2)  # prompts decoded at once (rows of an evaluate batch)


def _step(model, opt, ids: torch.Tensor, bf16: bool) -> float:
    os.environ[CPU_BF16] = "1" if bf16 else "0"
    t = time.perf_counter()
    with autocast(torch.device("cpu")):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def decode_tokens_per_s(model, prompts: list[list[int]]) -> float:
    from posttrain.engines.torch_rollout import sample
    t = time.perf_counter()
    out = sample(model, prompts, max_new_tokens=32, temperature=0.0, stop_ids=set(), pad_id=0)
    return sum(len(g.ids) for g in out) / (time.perf_counter() - t)


def decoding(model) -> dict:
    """Greedy decoding from fp32 weights against a bf16 copy, one thread, alternating; the best of REPEATS."""
    import copy
    from posttrain.models.attention import fast_decoding
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    models = {"fp32": model.eval(), "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    for m in models.values():
        fast_decoding(m)  # as the rollout engine serves a model
    prompts = torch.randint(1, SHAPE["vocab_size"], (DECODE, 64)).tolist()
    tps = {m: [] for m in models}
    for m in models:  # warm-up
        decode_tokens_per_s(models[m], prompts[:1])
    for _ in range(REPEATS):
        for m in models:
            tps[m].append(decode_tokens_per_s(models[m], prompts))
    torch.set_num_threads(threads_before)
    best = {m: round(max(v), 1) for m, v in tps.items()}
    print(f"bench/cpu_bf16: greedy decoding of {DECODE} x 32 tokens, 1 thread: fp32 {best['fp32']} tok/s, bf16 "
          f"{best['bf16']} tok/s ({best['bf16'] / best['fp32']:.2f}x)", flush=True)
    return {"decode_prompts": DECODE, "decode_new_tokens": 32, "decode_threads": 1,
            "decode_tokens_per_s_fp32": best["fp32"], "decode_tokens_per_s_bf16": best["bf16"],
            "decode_speedup_bf16_vs_fp32": round(best["bf16"] / best["fp32"], 3)}


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
    decode = decoding(model)
    fig = mark({"model": "SmolLM2-135M-Instruct's shapes, random weights", "layers": SHAPE["num_hidden_layers"],
                "threads": torch.get_num_threads(), "repeats": REPEATS, "best_of": "min seconds per mode",
                "peer": "the same step in fp32 (the embedded default), alternating in one process",
                "cpu": platform.processor() or platform.machine(), "cpu_bf16_flags": cpu_bf16_flags(),
                "torch": torch.__version__, "rows": rows,
                "speedup_bf16_vs_fp32": min(r["speedup_bf16_vs_fp32"] for r in rows), **decode})
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_bf16.json").write_text(json.dumps(fig, indent=1))
    print(f"bench/cpu_bf16: wrote {out / 'cpu_bf16.json'}")


if __name__ == "__main__":
    main()
