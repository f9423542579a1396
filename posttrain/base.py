"""base: train the BPE tokenizer on the curated corpus, build the tiny Llama, pretrain it briefly."""
from __future__ import annotations

from pathlib import Path

import torch

from posttrain.chat import doc_end_id, train_tokenizer
from posttrain.config import PipelineConfig
from posttrain.data import load_pretrain_texts
from posttrain.model import build_model, check_folder, load_checkpoint, n_params, save_checkpoint, seed_all
from posttrain.train import eval_loss, pack_stream, row_sampler, summarize, train


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    if cfg.base.init_from:  # a real model: take the user's local HF checkpoint as the base
        check_folder(cfg.base.init_from)
        model, tok = load_checkpoint(cfg.base.init_from)
        save_checkpoint(model, tok, out)
        return {"metrics": {"params": n_params(model)}, "params": {"init_from": cfg.base.init_from}}
    texts = load_pretrain_texts(inputs["curate"])
    tok = train_tokenizer(texts, cfg.tokenizer.vocab_size)
    model = build_model(cfg.model, tok)
    eos = doc_end_id(tok)
    docs = tok(texts, add_special_tokens=False)["input_ids"]
    rows = pack_stream(docs, cfg.base.seq_len, tok.bos_token_id, eos)
    n_val = max(1, len(rows) // 20)
    val_rows, train_rows = rows[:n_val][:64], rows[n_val:]
    val_batches = [{"input_ids": b, "loss_mask": torch.ones_like(b)} for b in val_rows.split(cfg.base.batch_size)]
    b = cfg.base
    hist = train(model, row_sampler(train_rows, b.batch_size, cfg.seed), steps=b.steps, lr=b.lr, warmup=b.warmup,
                 min_lr_ratio=b.min_lr_ratio, weight_decay=b.weight_decay, grad_clip=b.grad_clip, desc="base",
                 eval_fn=lambda: eval_loss(model, val_batches), eval_every=max(1, b.steps // 5))
    save_checkpoint(model, tok, out)
    metrics = {"params": n_params(model), "vocab_size": len(tok), "train_tokens": int(train_rows.numel()),
               **summarize(hist), **summarize(hist, "val_loss", 1)}
    return {"metrics": metrics, "history": hist}
