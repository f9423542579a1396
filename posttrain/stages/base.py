"""base: train the BPE tokenizer on the curated corpus, build the tiny Llama, pretrain it briefly; or, with
base.init_from, take a real checkpoint as it is (its source recorded for lineage)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from posttrain import checkpoint_rules
from posttrain.chat import ChatFormatError, chat_format, doc_end_id, train_tokenizer
from posttrain.config import ConfigError, PipelineConfig
from posttrain.data import load_pretrain_texts
from posttrain.engines import lm_engine
from posttrain.models import moe
from posttrain.models.preset import build_model, check_folder, load_checkpoint, n_params, save_checkpoint, seed_all
from posttrain.pipeline.artifacts import SOURCE, dir_digest
from posttrain.tools.pypi_checkpoints import source_of
from posttrain.train import eval_loss, moe_metrics, pack_stream, row_sampler, summarize, train


def check_checkpoint(cfg: PipelineConfig):
    """Everything about base.init_from that needs only the checkpoint, checked before the first stage: a loadable
    folder, a usable chat template (base.chat_template's when given) and, where a domain calls tools, one that
    renders tool calls; then every setting its config.json decides (posttrain.checkpoint_rules: attention, DSA,
    RoPE, quantize's group size, the megatron split, routing replay, MTP), all of them in one ConfigError. Returns
    the tokenizer with its template in place."""
    from transformers import AutoTokenizer  # transformers: at first use (the CLI's checks import this module)

    b = cfg.base
    check_folder(b.init_from)
    tok = AutoTokenizer.from_pretrained(b.init_from)
    if b.chat_template:
        if not Path(b.chat_template).is_file():
            raise ChatFormatError(f"base.chat_template: no such file {b.chat_template}")
        tok.chat_template = Path(b.chat_template).read_text()
    fmt = chat_format(tok)
    if errors := checkpoint_rules.chat_tools(cfg, tok, b.chat_template or f"{b.init_from}'s template ({fmt.template})"):
        raise ChatFormatError(errors[0])
    if errors := checkpoint_rules.check(cfg, b.init_from):
        raise ConfigError("\n  ".join(errors))
    return tok


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    if cfg.base.init_from:  # a real model: take the user's local HF checkpoint as the base
        tok = check_checkpoint(cfg)
        model, _ = load_checkpoint(cfg.base.init_from)
        save_checkpoint(model, tok, out)
        # where the weights came from, inside the artifact (so under its digest): lineage prints it
        source = {"init_from": cfg.base.init_from, "dir_sha256": dir_digest(cfg.base.init_from)}
        if fetched := source_of(cfg.base.init_from):  # fetched by posttrain: the wheel and GGUF it was converted from
            source["converted_from"] = {k: v for k, v in fetched.items() if k != "files"}
        (out / SOURCE).write_text(json.dumps(source, indent=1, sort_keys=True))
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
    # the tiny preset's pretraining runs in this process on the local engine whatever runtime.train_engine says (the
    # stage's cache key leaves the engine out; a real checkpoint skips this)
    engine = lm_engine(cfg, model, tok, lr=b.lr, weight_decay=b.weight_decay, moe=cfg.moe, engine="torch")
    hist = train(engine, row_sampler(train_rows, b.batch_size, cfg.seed), steps=b.steps, lr=b.lr, warmup=b.warmup,
                 min_lr_ratio=b.min_lr_ratio, grad_clip=b.grad_clip, desc="base",
                 eval_fn=lambda: eval_loss(model, val_batches), eval_every=max(1, b.steps // 5))
    engine.close()
    save_checkpoint(model, tok, out)
    moe.plot_load(hist, out / moe.PLOT, "base")
    metrics = {"params": n_params(model), "vocab_size": len(tok), "train_tokens": int(train_rows.numel()),
               **summarize(hist), **summarize(hist, "val_loss", 1), **moe_metrics(hist)}
    return {"metrics": metrics, "history": hist}
