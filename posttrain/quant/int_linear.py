"""Running a W4A8 compressed-tensors checkpoint on CPU with integer matmuls.

Each quantized Linear becomes an `IntLinear` (posttrain.quant.int_matmul): activations quantized per token to int8
on the fly, multiplied with the int8 (or int4, held unpacked as int8) weights by `torch._int_mm`, rescaled per group;
a GLM-5 layer's routed experts then run grouped (posttrain.quant.int_experts). transformers' own compressed-tensors
loader only decompresses to float weights, and torchao's int4 paths need CUDA/XPU kernels: this is the CPU path our
evaluation runs on. On CUDA, 4-bit weights go through the packed W4A8 Triton kernel (`kernels.w4a8`) instead."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from posttrain.models import glm5, moe, mtp
from posttrain.models.preset import load_checkpoint, restore
from posttrain.quant.int_experts import group_int_experts
from posttrain.quant.int_matmul import IntLinear


def _check_scheme(path: Path, name: str, scheme: dict) -> tuple[int, int]:
    w, a = scheme.get("weights") or {}, scheme.get("input_activations") or {}
    ok = (w.get("type") == "int" and w.get("symmetric") and w.get("strategy") in ("group", "channel")
          and a.get("type") == "int" and a.get("dynamic") is True and a.get("strategy") == "token")
    if not ok:
        raise ValueError(f"{path / 'config.json'}: quantization_config.config_groups.{name}: only symmetric int "
                         f"group/channel weights with dynamic per-token int activations run on the CPU integer "
                         f"kernels (got weights={w}, input_activations={a})")
    return w["num_bits"], a["num_bits"]


def load_compressed(path: str | Path):
    """Model (float32 outside the quantized Linears) and tokenizer from a compressed-tensors W4A8 folder."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    qc = config.quantization_config
    del config.quantization_config  # keep transformers from decompressing to float weights itself
    bits = {n: _check_scheme(path, n, s) for n, s in qc["config_groups"].items()}
    packed_bits = {bits[n][0] for n, s in qc["config_groups"].items() if s.get("format") == "pack-quantized"}
    act_bits = max(a for _, a in bits.values())
    if len(packed_bits) > 1:
        raise ValueError(f"{path / 'config.json'}: pack-quantized groups of different widths {sorted(packed_bits)}")
    model = restore(AutoModelForCausalLM.from_config(config, dtype=torch.float32)).eval()
    moe.unfuse_experts(model)  # GLM-5's routed experts are stored one Linear each, quantized as such
    tensors = load_file(str(path / "model.safetensors"))
    if glm5.is_glm5(model) and mtp.get(model) is not None:  # its draft layer where GLM-5 keeps it
        tensors = mtp.from_glm5_state(model, tensors)
    replaced = set()
    for name, module in list(model.named_modules()):
        if f"{name}.weight_scale" not in tensors:
            continue
        w_bits = 8
        if f"{name}.weight_packed" in tensors:
            shape = torch.Size(tensors[f"{name}.weight_shape"].tolist())
            w_bits = min(packed_bits)
            q = unpack_from_int32(tensors[f"{name}.weight_packed"], w_bits, shape)
        else:
            q = tensors[f"{name}.weight"]
        model.set_submodule(name, IntLinear(q, tensors[f"{name}.weight_scale"], act_bits, w_bits))
        replaced.add(name)
    rest = {k: v.float() for k, v in tensors.items() if k.rsplit(".", 1)[0] not in replaced}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in replaced
               and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path / 'model.safetensors'}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    group_int_experts(model)  # routed experts in grouped launches where the Triton kernel runs
    return model, AutoTokenizer.from_pretrained(path)


def is_compressed(path: str | Path) -> bool:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("quantization_config", {}).get("quant_method") == "compressed-tensors"


def load_any(path: str | Path):
    """A checkpoint folder, plain or compressed-tensors W4A8, as (model, tokenizer)."""
    return load_compressed(path) if is_compressed(path) else load_checkpoint(path)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold in memory (tied tensors once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values())
