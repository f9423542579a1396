"""ramp: mid-training at growing sequence lengths, RoPE base raised per stage, long-context data mixed in.

Each stage's checkpoint is kept under `stages/<seq_len>/`; the artifact root holds the last one.
The RoPE settings go into config.json so serving engines read them.
"""
from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from environments import long_context
from posttrain.config import PipelineConfig
from posttrain.curate import load_pretrain_texts
from posttrain.model import load_checkpoint, save_checkpoint, seed_all
from posttrain.train import pack_stream, pad_examples, summarize, train


def _long_docs(tok, seq_len: int, n: int, seed: int) -> list[list[int]]:
    """Long-context training documents: filler with a buried fact, then the question and answer."""
    def count(t):
        return len(tok(t.prompt + f" Answer: {t.answer}.", add_special_tokens=False)["input_ids"]) + 2
    tasks = long_context.fit_to_length("train", n, seed, seq_len, count)
    return [tok(t.prompt + f" Answer: {t.answer}.", add_special_tokens=False)["input_ids"] for t in tasks]


def with_rope(model, rope_theta: float, max_positions: int):
    """Rebuild the model with a new RoPE base (inv_freq is derived from config, not stored)."""
    config = AutoConfig.for_model(**model.config.to_dict())
    config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": rope_theta}
    config.max_position_embeddings = max_positions
    new = AutoModelForCausalLM.from_config(config).float()
    new.load_state_dict(model.state_dict())
    return new


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    model, tok = load_checkpoint(inputs["base"])
    texts = load_pretrain_texts(inputs["curate"])
    docs = tok(texts, add_special_tokens=False)["input_ids"]
    eos = tok.convert_tokens_to_ids("<|eos|>")
    r = cfg.ramp
    hist_all: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    for k, st in enumerate(r.stages):
        model = with_rope(model, st.rope_theta, st.seq_len)
        rows = pack_stream(docs, st.seq_len, tok.bos_token_id, eos)
        longs = [[tok.bos_token_id, *d, eos] for d in _long_docs(tok, st.seq_len, 256, cfg.seed + k)]
        n_long = max(1, round(r.batch_size * st.long_share))

        def next_batch(step: int, k=k, st=st, rows=rows, longs=longs, n_long=n_long):
            rng = random.Random(cfg.seed * 7919 + k * 100_003 + step)
            short = [rows[rng.randrange(len(rows))].tolist() for _ in range(r.batch_size - n_long)]
            ex = [(x, [1] * len(x)) for x in short + [rng.choice(longs) for _ in range(n_long)]]
            return pad_examples(ex, tok.pad_token_id, st.seq_len)

        hist = train(model, next_batch, steps=st.steps, lr=st.lr, warmup=r.warmup, desc=f"ramp@{st.seq_len}")
        for key, xs in hist.items():
            hist_all[f"{key}@{st.seq_len}"] = xs
        metrics.update({f"{k2}@{st.seq_len}": v for k2, v in summarize(hist).items()})
        save_checkpoint(model, tok, out / "stages" / str(st.seq_len))
    save_checkpoint(model, tok, out)
    metrics["final_seq_len"] = r.stages[-1].seq_len
    return {"metrics": metrics, "history": hist_all}
