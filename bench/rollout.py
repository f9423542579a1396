"""bench/rollout: the SGLang rollout engine (a real server, `make sglang`) against the torch engine, same process.

- `tokens_per_s_{torch,sglang}_b{1,64}`: greedy generation of `NEW` tokens for 1 and 64 prompts (no stop), the
  engines alternating `REPEATS` times after a warm-up call each; the best repeat.
- `greedy_identical`: both engines' tokens equal at every batch size; `logprob_abs_diff_mean`: their per-token
  log-probabilities' mean absolute difference.
- `weight_sync_s_disk`: `update_weights` from a checkpoint folder, until the next generation may start;
  `weight_sync_s_broadcast`: from a state dict in this process, broadcast to the server (gloo on CPU, NCCL on
  CUDA), its process group already made (the first broadcast, which makes it, is `weight_sync_s_broadcast_first`).
- `sglang_start_s`: the server's start, from launch to ready.

    python -m bench.rollout [--shape tiny|0.5b]     (make bench B=rollout)

BENCH_SMALL=1: the tiny shape, 16 new tokens, 4 prompts instead of 64, one repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import mark, out_dir, size, threads
from bench.megatron import SHAPES, checkpoint

OUT = out_dir()
REPEATS = size(3, 1)
NEW = size(128, 16)
BATCHES = (1, size(64, 4))


def timed(engine, prompts: list[list[int]]) -> tuple[list, float]:
    t = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=NEW, temperature=0.0, stop_ids=set())
    return out, time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b" if torch.cuda.is_available() else "tiny")
    shape = size(p.parse_args(argv if argv is not None else []).shape, "tiny")  # `python -m bench` calls main() bare
    torch.set_num_threads(threads(2))
    from posttrain.engines.sglang_rollout import SGLangRolloutEngine
    from posttrain.engines.sglang_server import ServerError, sglang_python
    from posttrain.engines.torch_rollout import TorchRolloutEngine
    from posttrain.models.preset import load_checkpoint, save_checkpoint
    try:
        sglang_python()
    except ServerError as e:
        print(f"bench/rollout: {e}; skipped")
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint(shape, Path(d) / shape)
        t = time.perf_counter()
        sgl = SGLangRolloutEngine(path)
        fig = {"device": device, "shape": shape, "new_tokens": NEW, "repeats": REPEATS,
               "sglang_start_s": round(time.perf_counter() - t, 2), "dtype": "float32" if device.startswith("cpu")
               else "bf16 (sglang) / fp32 (torch)"}
        ref = TorchRolloutEngine.from_checkpoint(path)
        vocab = SHAPES[shape]["vocab_size"]
        g = torch.Generator().manual_seed(0)
        identical, diffs = True, []
        try:
            for b in BATCHES:
                prompts = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(b)]
                times = {"torch": [], "sglang": []}
                for name, engine in (("torch", ref), ("sglang", sgl)):
                    timed(engine, prompts[:1])  # warm-up
                outs = {}
                for _ in range(REPEATS):
                    for name, engine in (("torch", ref), ("sglang", sgl)):
                        outs[name], s = timed(engine, prompts)
                        times[name].append(s)
                for name in times:
                    fig[f"tokens_per_s_{name}_b{b}"] = round(b * NEW / min(times[name]), 1)
                for x, y in zip(outs["torch"], outs["sglang"]):
                    identical &= x.ids == y.ids
                    diffs += [abs(a - c) for a, c in zip(x.logprobs, y.logprobs)]
            fig["greedy_identical"] = identical
            fig["logprob_abs_diff_mean"] = sum(diffs) / len(diffs)
            model, tok = load_checkpoint(path)
            with torch.no_grad():
                for q in model.parameters():
                    q.mul_(1.01)
            save_checkpoint(model, tok, Path(d) / "next")
            t = time.perf_counter()
            sgl.update_weights(str(Path(d) / "next"), version=1)
            fig["weight_sync_s_disk"] = round(time.perf_counter() - t, 3)
            for key, version in (("weight_sync_s_broadcast_first", 2), ("weight_sync_s_broadcast", 3)):
                t = time.perf_counter()
                sgl.update_weights(model.state_dict(), version=version)
                fig[key] = round(time.perf_counter() - t, 3)
        finally:
            sgl.close()
    for b in BATCHES:
        fig[f"speed_ratio_b{b}"] = round(fig[f"tokens_per_s_sglang_b{b}"] / fig[f"tokens_per_s_torch_b{b}"], 3)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rollout.json").write_text(json.dumps(mark(fig), indent=1) + "\n")
    print(json.dumps(mark(fig), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
