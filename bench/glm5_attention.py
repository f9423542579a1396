"""bench/glm5_attention: GLM-5's attention through transformers' own sdpa function against posttrain's `mla_sdpa`
(`models.glm5`: MLA's 32-dim values padded to the 48 dims of queries and keys on CPU, so that torch's flash kernel
takes a masked attention instead of the math path).

The tiny profile's model, the two functions swapped in one process, their reps interleaved: training steps (forward
and backward, no optimizer step, so both see the same weights) at the shapes the pipeline trains (base 16 x 128,
the first rung 8 x 256 dense, sparse steps with DSA adopted at top 128 and the indexers' KL at 16 x 256 and 16 x
512; every other row padded by a quarter, as sft's length buckets pad), and greedy generation of 48 tokens for 64
prompts of ~100 and ~480 tokens. Per shape: median seconds of each, their ratio, the largest gradient difference
(or whether the tokens are the same). Writes .posttrain/bench/glm5_attention.json.

    python -m bench.glm5_attention [--reps 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench import mark, out_dir, size, threads

TRAIN = [(16, 128, False), (8, 256, False), (16, 256, True), (16, 512, True)]  # batch, length, DSA adopted
GENERATE = [(64, 100), (64, 480)]  # prompts, their length


def _timed(run, reps: int, use) -> tuple[dict, dict]:
    """Each side's median seconds over `reps` interleaved calls of `run()` (after one warm-up each; `use(side)` swaps
    the attention in), and its output on the first call."""
    ts, first = {"transformers": [], "posttrain": []}, {}
    for i in range(reps + 1):
        for side in ts:
            use(side)
            t = time.perf_counter()
            out = run()
            if i:
                ts[side].append(time.perf_counter() - t)
            else:
                first[side] = out
    use("posttrain")
    return {k: statistics.median(v) for k, v in ts.items()}, first


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.glm5_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=size(4, 1))
    args = ap.parse_args(argv if argv is not None else [])
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AttentionInterface, PreTrainedTokenizerFast
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from posttrain.config import load_config
    from posttrain.engines.lm import LMLoss, masked_lm_loss
    from posttrain.engines.torch_rollout import sample
    from posttrain.models import glm5
    from posttrain.models.preset import build_model, seed_all
    ours = glm5.mla_sdpa

    def use(side: str) -> None:
        fn = sdpa_attention_forward if side == "transformers" else ours
        AttentionInterface.register("sdpa", fn)
        glm5.mla_sdpa = fn  # DSA's attention calls it by name

    torch.set_num_threads(threads(2))
    cfg = load_config("tiny")
    vocab = {f"t{i}": i for i in range(cfg.tokenizer.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  bos_token="t1", eos_token="t2", pad_token="t3")
    fig = {"what": __doc__.split("\n\n")[0], "model": "tiny (GLM-5)", "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "peer": "transformers.integrations.sdpa_attention.sdpa_attention_forward",
           "train": [], "generate": []}
    gen = torch.Generator().manual_seed(0)

    def model(sparse: bool):
        seed_all(0)
        m = build_model(cfg.model, tok).float()
        return glm5.install_dsa(m, 128) if sparse else m

    for b, L, sparse in size(TRAIN, [(2, 64, False), (2, 320, True)]):
        m = model(sparse).train()
        ids = torch.randint(5, cfg.tokenizer.vocab_size, (b, L), generator=gen)
        mask = torch.ones_like(ids)
        mask[::2, -L // 4:] = 0
        batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": mask}
        loss = LMLoss(m, dsa_weight=1.0) if sparse else masked_lm_loss

        def step():
            loss(m, batch).backward()
            g = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
            m.zero_grad()
            return g
        secs, grads = _timed(step, args.reps, use)
        point = {"batch": b, "seq_len": L, "dsa": sparse, **{f"{k}_s": round(v, 3) for k, v in secs.items()},
                 "speedup": round(secs["transformers"] / secs["posttrain"], 2),
                 "grad_max_abs_diff": float((grads["transformers"] - grads["posttrain"]).abs().max()),
                 "grad_max_abs": float(grads["transformers"].abs().max())}
        fig["train"].append(point)
        print(f"train {b} x {L}{' DSA' if sparse else ''}: transformers {secs['transformers']:.3f} s, posttrain "
              f"{secs['posttrain']:.3f} s, x{point['speedup']}; gradients differ by {point['grad_max_abs_diff']:.1e} "
              f"at most (largest {point['grad_max_abs']:.1e})", flush=True)
    m = model(True).eval()
    for n, L in size(GENERATE, [(4, 300)]):
        prompts = [torch.randint(5, cfg.tokenizer.vocab_size, (L - (i % 7) * 3,), generator=gen).tolist()
                   for i in range(n)]
        secs, outs = _timed(lambda: [g.ids for g in sample(m, prompts, max_new_tokens=size(48, 8), temperature=0.0,
                                                             stop_ids=set(), pad_id=3)], args.reps, use)
        point = {"prompts": n, "prompt_len": L, **{f"{k}_s": round(v, 3) for k, v in secs.items()},
                 "speedup": round(secs["transformers"] / secs["posttrain"], 2),
                 "same_tokens": outs["transformers"] == outs["posttrain"]}
        fig["generate"].append(point)
        print(f"generate {n} x ~{L} tokens: transformers {secs['transformers']:.2f} s, posttrain "
              f"{secs['posttrain']:.2f} s, x{point['speedup']}; the same tokens: {point['same_tokens']}", flush=True)
    path = out_dir() / "glm5_attention.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mark(fig), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
