"""bench/glm5_indexer: GLM-5's DSA indexer, transformers' own forward against posttrain's (`models.glm5`).

Both score the same keys for the same queries in the tiny profile's model with DSA adopted (top 128): the library's
broadcast matmul `[b, s, h, d] x [b, 1, d, t]` copies the keys once per query position, posttrain's one `bmm` per
row does not (and selects with a stable sort, so ties do not depend on the length). Per length: seconds per indexer
forward of each (no grad, the median of `--reps`), their ratio, and the share of queries whose selected keys are the
same set.

Then a training step of the same model (fwd + bwd + AdamW, batch x `--step-len` tokens) three ways, their reps
interleaved: without the indexers' KL; with it as posttrain computes it (the scores of the KL's `kl_queries` rows
recomputed with their graph); with it from every query's scores kept for backward (how posttrain did before
2026-11-30, and what the library's indexer, which returns indices only, leaves no other way to). The KL's cost is
each KL step's seconds less the step without. Writes .posttrain/bench/glm5_indexer.json.

    python -m bench.glm5_indexer [--batch 16] [--lengths 256 512 1024] [--reps 5] [--step-len 512]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench import mark, out_dir, size, threads

TOP_K = 128  # the tiny profile's ramp.dsa.top_k


def _capture(model, ids):
    """The first indexer's call arguments in one forward of `model` on `ids`."""
    import torch
    layer = next(layer for layer in model.model.layers if layer.self_attn.indexer is not None)
    seen = {}

    def grab(_module, args, kwargs):
        seen.setdefault("call", (args, kwargs))
    hook = layer.self_attn.indexer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(ids, use_cache=False)  # a cache would grow with every replayed call
    hook.remove()
    return layer.self_attn.indexer, *seen["call"]


def _seconds(fn, reps: int) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(reps + 1):  # the first call warms up
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[1:]), out


def _train_steps(model, ids, reps: int) -> dict:
    """Median seconds of a training step without the indexers' KL, with it (rows recomputed), with it from every
    query's scores kept (see the module's docstring)."""
    import torch

    from posttrain.engines.lm import LMLoss, masked_lm_loss
    from posttrain.models import dsa
    st = dsa.state(model)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with_kl = LMLoss(model, dsa_weight=1.0)  # sets the state's `collect` while it lives

    class KeepAll(dict):  # each layer's scores for every query computed with their graph, the KL's rows cut out
        def __setitem__(self, layer, rows_fn):
            every = rows_fn(torch.arange(ids.shape[1]))
            super().__setitem__(layer, lambda rows: every[:, rows])

    def step(way: str) -> float:
        st.collect = way != "no_kl"
        st.scores = KeepAll() if way == "kl_every_query" else {}
        t = time.perf_counter()
        (with_kl if st.collect else masked_lm_loss)(model, batch).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t
    ways = ("no_kl", "kl_rows", "kl_every_query")
    times = {w: [] for w in ways}
    for w in ways:
        step(w)  # warm-up
    for _ in range(reps):
        for w in ways:
            times[w].append(step(w))
    with_kl.close()
    st.scores = {}
    return {f"{w}_s": round(statistics.median(ts), 3) for w, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.glm5_indexer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=size(16, 2))
    ap.add_argument("--lengths", type=int, nargs="+", default=size([256, 512, 1024], [192]))
    ap.add_argument("--reps", type=int, default=size(5, 1))
    ap.add_argument("--step-len", type=int, default=size(512, 192), help="tokens a row in the training step")
    args = ap.parse_args(argv if argv is not None else [])
    if min(args.lengths) <= TOP_K:
        ap.error(f"--lengths: each must exceed the top {TOP_K} keys the indexer keeps (got {args.lengths})")
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    from posttrain.config import load_config
    from posttrain.models import glm5
    from posttrain.models.preset import build_model, seed_all
    torch.set_num_threads(threads(2))
    cfg = load_config("tiny")
    vocab = {f"t{i}": i for i in range(cfg.tokenizer.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  bos_token="t1", eos_token="t2", pad_token="t3")
    seed_all(0)
    model = glm5.install_dsa(build_model(cfg.model, tok).float().eval(), TOP_K)
    fig = {"what": __doc__.split("\n\n")[0], "model": "tiny (GLM-5)", "top_k": TOP_K, "batch": args.batch,
           "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "peer": "transformers GlmMoeDsaIndexer.forward",
           "points": []}
    for L in args.lengths:
        ids = torch.randint(5, cfg.tokenizer.vocab_size, (args.batch, L), generator=torch.Generator().manual_seed(L))
        indexer, a, kw = _capture(model, ids)
        with torch.no_grad():
            ours_s, ours = _seconds(lambda: indexer(*a, **kw), args.reps)
            peer_s, peer = _seconds(lambda: GlmMoeDsaIndexer.forward(indexer, *a, **kw), args.reps)
            glm5._indexer_forward(indexer, *a, train=True, **kw)  # keeps its scores on the model's DSA state
            scores = indexer.dsa_state.scores.pop(indexer.layer_idx)(torch.arange(L)).sort(-1, descending=True).values
        # where the k-th and (k+1)-th best scores tie (a random indexer's ReLU scores many keys exactly 0, and early
        # queries have fewer than k keys), the two sorts may pick different keys: compare the rest
        clear = scores[..., TOP_K - 1] > scores[..., TOP_K]
        same = (ours.sort(-1).values == peer.long().sort(-1).values).all(-1)[clear].float().mean().item()
        point = {"seq_len": L, "posttrain_s": round(ours_s, 4), "transformers_s": round(peer_s, 4),
                 "speedup": round(peer_s / ours_s, 2), "untied_queries": round(clear.float().mean().item(), 4),
                 "same_selection_untied": round(same, 4)}
        fig["points"].append(point)
        print(f"L={L}: posttrain {ours_s:.3f} s, transformers {peer_s:.3f} s, x{point['speedup']}; the same keys "
              f"on {same:.1%} of the {clear.float().mean().item():.0%} of queries without a tie at the k-th", flush=True)
    ids = torch.randint(5, cfg.tokenizer.vocab_size, (args.batch, args.step_len),
                        generator=torch.Generator().manual_seed(0))
    step = {"seq_len": args.step_len, **_train_steps(model.train(), ids, args.reps)}
    step["kl_cost_rows_s"] = round(step["kl_rows_s"] - step["no_kl_s"], 3)
    step["kl_cost_every_query_s"] = round(step["kl_every_query_s"] - step["no_kl_s"], 3)
    step["speedup_with_kl"] = round(step["kl_every_query_s"] / step["kl_rows_s"], 2)
    fig["train_step"] = step
    print(f"training step, {args.batch} x {args.step_len}: {step['no_kl_s']:.2f} s without the indexers' KL, "
          f"{step['kl_rows_s']:.2f} s with it (its rows recomputed), {step['kl_every_query_s']:.2f} s with every "
          f"query's scores kept: the KL costs {step['kl_cost_rows_s']:.2f} s against "
          f"{step['kl_cost_every_query_s']:.2f} s", flush=True)
    path = out_dir() / "glm5_indexer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mark(fig), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
