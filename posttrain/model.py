"""Tiny Llama preset, and checkpoints as plain Hugging Face folders (fp32 on CPU)."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from posttrain.config import ModelConfig

hf_logging.disable_progress_bar()  # per-load bars drown the stage progress


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(cfg: ModelConfig, tok) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(config).float()


def load_checkpoint(path: str | Path) -> tuple[LlamaForCausalLM, object]:
    """Load model + tokenizer with the plain Auto classes, as any HF user would."""
    tok = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tok


def save_checkpoint(model, tok, out: str | Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
