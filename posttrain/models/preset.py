"""The presets (a tiny Llama; GLM-5's MoE architecture), and checkpoints as plain Hugging Face folders (fp32 on CPU)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM,
                          LlamaConfig, LlamaForCausalLM)
from transformers.utils import logging as hf_logging

from posttrain.config import ModelConfig
from posttrain.models import dsa, glm5, mtp

hf_logging.disable_progress_bar()  # per-load bars drown the stage progress


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# DSA's indexer keeps min(index_topk, T) keys: a built glm5 model attends densely until the ramp adopts DSA
DENSE_TOPK = glm5.DENSE_TOPK


def build_model(cfg: ModelConfig, tok) -> torch.nn.Module:
    """The preset of `cfg.arch`, random, fp32."""
    if cfg.arch == "glm5":
        return build_glm5(cfg, tok)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(config).float()


def build_glm5(cfg: ModelConfig, tok) -> torch.nn.Module:
    """GLM-5's architecture (transformers' GlmMoeDsaForCausalLM) at `cfg`'s size. Untied embeddings as GLM-5's;
    the router weights get the initialiser's normal draw (transformers leaves them at zero, where every expert
    ties and top-k picks by index). Its DSA indexers select stably (posttrain.models.glm5.stable_indexers)."""
    n_dense = cfg.first_k_dense_replace
    config = GlmMoeDsaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=True, first_k_dense_replace=n_dense,
        mlp_layer_types=["dense"] * n_dense + ["sparse"] * (cfg.num_layers - n_dense),
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, index_topk=DENSE_TOPK,
        index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim, indexer_types=cfg.layer_indexers(),
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = glm5.stable_indexers(GlmMoeDsaForCausalLM(config).float())
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, config.initializer_range)
    return model


SAVE_DTYPE = "posttrain_dtype"  # set at load: the dtype family the checkpoint's chain is written in
MAX_SHARD = "2GB"                # safetensors shards past this size, with an index


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used; the message names the folder and what is missing."""


def check_folder(path: str | Path) -> None:
    """Fail before any work on a folder that is not a loadable Hugging Face chat checkpoint: config, a known
    architecture, weights (single or sharded), a tokenizer with a chat template, embeddings for every token."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory")
    missing = [n for n, ok in [("config.json", (p / "config.json").is_file()),
                               ("weights (*.safetensors)", any(p.glob("*.safetensors"))),
                               ("a tokenizer (tokenizer.json)", (p / "tokenizer.json").is_file())] if not ok]
    if missing:
        raise CheckpointError(f"{p}: missing {', '.join(missing)}")
    try:
        config = AutoConfig.from_pretrained(p)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{p}: unknown architecture in config.json ({e})") from None
    if errors := glm5.config_errors(config):
        raise CheckpointError(f"{p / 'config.json'}: {'; '.join(errors)}")
    tok_config = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").is_file() else {}
    if not tok_config.get("chat_template") and not (p / "chat_template.jinja").is_file():
        raise CheckpointError(f"{p}: no chat template (neither tokenizer_config.json's chat_template nor "
                              f"chat_template.jinja); sft, rl and evaluation render conversations with it")
    tok = AutoTokenizer.from_pretrained(p)
    rows = _embedding_rows(p)
    if rows is not None and (rows != config.vocab_size or len(tok) > rows):
        raise CheckpointError(f"{p}: shapes do not match: the embedding has {rows} rows, config.json says "
                              f"vocab_size {config.vocab_size}, the tokenizer has {len(tok)} tokens")


def _embedding_rows(p: Path) -> int | None:
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                if key.endswith("embed_tokens.weight"):
                    return st.get_slice(key).get_shape()[0]
    return None


def load_checkpoint(path: str | Path) -> tuple[LlamaForCausalLM, object]:
    """Load model + tokenizer with the plain Auto classes, as any HF user would: fp32 to train on CPU, single or
    sharded safetensors. The checkpoint's own dtype is remembered, so `save_checkpoint` writes the same family."""
    tok = AutoTokenizer.from_pretrained(path)
    model = load_pretrained(AutoModelForCausalLM, path)
    saved = json.loads((Path(path) / "config.json").read_text())
    setattr(model.config, SAVE_DTYPE, saved.get("dtype") or saved.get("torch_dtype") or "float32")
    return model, tok


def load_pretrained(auto_class, path: str | Path):
    """`auto_class.from_pretrained` in fp32, as posttrain runs it (`restore`)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # else transformers reports the indexers' weights as unexpected
    try:
        model = auto_class.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)
    return restore(model, path)


def restore(model, checkpoint: str | Path | None = None):
    """A model transformers built (from a checkpoint or a config) as posttrain runs it: GLM-5's indexers selecting
    stably (posttrain.models.glm5), the DSA indexers and MTP layer its config names reinstalled, their weights from
    `checkpoint` when given. Every path that builds or loads a model for posttrain's use goes through it."""
    return mtp.restore(dsa.restore(glm5.stable_indexers(model), checkpoint), checkpoint)


def save_checkpoint(model, tok, out: str | Path, max_shard_size: str = MAX_SHARD) -> None:
    """Save in the dtype family of the checkpoint the chain started from (bf16 in, bf16 out), sharded past
    `max_shard_size`."""
    name = model.config.__dict__.pop(SAVE_DTYPE, "float32")  # runtime only: config.json's dtype says it
    try:
        dtype = getattr(torch, str(name), None)
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        state = None
        if dtype != torch.float32:
            state, cast = {}, {}  # tied weights stay one tensor, cast once
            # what the model keeps in fp32 stays so (GLM-5's e_score_correction_bias: 1e-3 balancing steps are
            # below a bf16 ulp near its values)
            keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
            for k, v in model.state_dict().items():
                if keep and any(name in k for name in keep):
                    state[k] = v.detach()
                    continue
                if v.data_ptr() not in cast:
                    cast[v.data_ptr()] = v.detach().to(dtype)
                state[k] = cast[v.data_ptr()]
        if glm5.is_glm5(model) and mtp.get(model) is not None:  # the draft layer where GLM-5 keeps it
            state = mtp.glm5_state(model, state if state is not None else model.state_dict())
        model.save_pretrained(out, safe_serialization=True, state_dict=state, max_shard_size=max_shard_size)
        if state is not None:  # config.json says what the files hold
            cfg_path = Path(out) / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["dtype"] = str(dtype).removeprefix("torch.")
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    finally:  # kept for the next save, even when this one failed
        setattr(model.config, SAVE_DTYPE, name)
    tok.save_pretrained(out)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
