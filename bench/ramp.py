"""bench/ramp: training tokens/s and peak memory against sequence length, for the tiny model.

Variants, each in its own process (peak RSS is per process): packed rows with sdpa's document masks, the
same rows through `packed_sdpa` (the ramp's default: no scores between documents, posttrain.models.packed_attention),
the same rows with one causal mask over the row (classic packing: cheaper, documents see each other),
masks + activation checkpointing, and no packing at all (one document per row, padded
to the longest in the batch, up to PADDED_MAX): its tokens/s counts real tokens only. Every step holds
the same number of tokens (rows = TOKENS_PER_STEP / seq_len), so the lengths compare at equal work.

BENCH_SMALL=1 (bench/__init__.py): lengths 64 and 128 (unpacked up to 64), 512 tokens a step, 2 timed steps after
one, every variant, each in this process (`children_in_process`), one thread.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

from bench import children_in_process, mark, out_dir, size, threads

OUT = out_dir()
SEQ_LENS = size([256, 512, 1024, 2048, 4096], [64, 128])
PADDED_MAX = size(1024, 64)  # unpacked rows pad to the longest document: beyond this the batch no longer fits in memory
TOKENS_PER_STEP = size(8192, 512)
STEPS, WARMUP = size(6, 2), size(2, 1)
VARIANTS = {"": dict(mask=True, ckpt=False, packed=True), "_packed_sdpa": dict(mask=True, ckpt=False, packed=True,
                                                                             attn="packed_sdpa"),
            "_nomask": dict(mask=False, ckpt=False, packed=True),
            "_ckpt": dict(mask=True, ckpt=True, packed=True), "_padded": dict(mask=True, ckpt=False, packed=False)}


def _docs(n_tokens: int, seq_len: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """Pretraining-like lengths: mostly short documents, a long tail up to the row length."""
    docs, total = [], 0
    while total < n_tokens:
        n = min(seq_len, int(rng.paretovariate(1.2) * 60))
        docs.append(([rng.randrange(3, 512) for _ in range(n)], [1] * n))
        total += n
    return docs


def _measure(seq_len: int, mask: bool, ckpt: bool, packed: bool, attn: str = "sdpa") -> dict:
    import torch

    from posttrain.models import attention
    from posttrain.config import load_config
    from posttrain.pipeline.memory import peak_memory
    from posttrain.packing import collate, pack
    from posttrain.train import pad_examples
    from posttrain.engines.lm import masked_lm_loss

    torch.set_num_threads(threads(2))
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM
    m = load_config("tiny-dense").model
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_heads, intermediate_size=m.intermediate_size, max_position_embeddings=seq_len,
        tie_word_embeddings=True)).float().train()
    attention.use(model, attn)
    if ckpt:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(0)
    rows_per_step = max(1, TOKENS_PER_STEP // seq_len)
    batches = []
    for _ in range(STEPS + WARMUP):
        docs = _docs(TOKENS_PER_STEP, seq_len, rng)
        if packed:
            batches.append(collate(pack(docs, seq_len)[:rows_per_step], 0, mask_documents=mask))
        else:  # one document per row: as many rows as packing would fill, at their real lengths
            rng.shuffle(docs)
            take, n = [], 0
            while n < rows_per_step * seq_len * 0.97 and docs:
                take.append(docs.pop())
                n += len(take[-1][0])
            batches.append(pad_examples(take, 0, seq_len))
    real = [int((b["attention_mask"] if "attention_mask" in b else torch.ones_like(b["input_ids"])).sum())
            for b in batches]
    with peak_memory() as peak:
        for i, b in enumerate(batches):
            if i == WARMUP:
                t = time.perf_counter()
            opt.zero_grad()
            masked_lm_loss(model, b).backward()
            opt.step()
        seconds = time.perf_counter() - t
    return {"tokens_per_s": round(sum(real[WARMUP:]) / seconds, 1), "peak_rss_mb": peak["mb"]}


def main() -> None:
    fig: dict = {"seq_lens": SEQ_LENS, "tokens_per_step": TOKENS_PER_STEP}
    for suffix, v in VARIANTS.items():
        for key in ("tokens_per_s", "peak_rss_mb"):
            fig[key + suffix] = []
        for L in SEQ_LENS:
            if suffix == "_padded" and L > PADDED_MAX:
                for key in ("tokens_per_s", "peak_rss_mb"):
                    fig[key + suffix].append(None)
                continue
            if children_in_process():
                res = _measure(L, **v)
            else:
                p = subprocess.run([sys.executable, "-m", "bench.ramp", "_one", str(L), json.dumps(v)],
                                   capture_output=True, text=True)
                if p.returncode:
                    raise RuntimeError(f"bench.ramp {L} {v} failed:\n{p.stderr[-3000:]}")
                res = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"seq_len {L:5d} {suffix or '_masks':8s} {res}", flush=True)
            for key in ("tokens_per_s", "peak_rss_mb"):
                fig[key + suffix].append(res[key])
    fig["packed_sdpa_speedup"] = [round(a / b, 3) for a, b in zip(fig["tokens_per_s_packed_sdpa"], fig["tokens_per_s"])]
    fig["mask_cost_at_max_len"] = round(fig["tokens_per_s"][-1] / fig["tokens_per_s_nomask"][-1], 3)
    fig["ckpt_memory_ratio_at_max_len"] = round(fig["peak_rss_mb_ckpt"][-1] / fig["peak_rss_mb"][-1], 3)
    i = SEQ_LENS.index(PADDED_MAX)
    fig[f"packing_speedup_at_{PADDED_MAX}"] = round(fig["tokens_per_s"][i] / fig["tokens_per_s_padded"][i], 3)
    fig = mark(fig)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ramp.json").write_text(json.dumps(fig, indent=1))
    _plot(fig, OUT / "ramp.png")
    print(json.dumps(fig, indent=1))


def _plot(fig: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = {"": "packed + document masks (sdpa)", "_packed_sdpa": "packed, packed_sdpa", "_nomask": "packed, one causal mask", "_ckpt": "masks + act. ckpt",
             "_padded": "no packing (padded)"}
    f, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for suffix, name in names.items():
        xs = [x for x, y in zip(fig["seq_lens"], fig["tokens_per_s" + suffix]) if y is not None]
        a.plot(xs, fig["tokens_per_s" + suffix][:len(xs)], marker="o", label=name)
        b.plot(xs, fig["peak_rss_mb" + suffix][:len(xs)], marker="o", label=name)
    for ax, label in ((a, "training tokens/s (real tokens)"), (b, "peak RSS (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend()
    f.suptitle(f"tiny model, {fig['tokens_per_step']} tokens per step, 2 CPU cores")
    f.tight_layout()
    f.savefig(path, dpi=100)
    plt.close(f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        print(json.dumps(_measure(int(sys.argv[2]), **json.loads(sys.argv[3]))))
    else:
        main()
