"""quantize: W4A8. int4 group-wise weights for MLP blocks, int8 per-channel for attention projections,
int8 per-token activations. Stored as packed integers + scales in safetensors, described by a
`quantization_config` in config.json.

Written by hand because torchao's int4 paths need CUDA/XPU kernels and its CPU int8 path does not
produce the mixed int4-MLP / int8-attention layout the recipe asks for.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from posttrain.config import PipelineConfig
from posttrain.model import load_checkpoint, seed_all

METHOD = "posttrain-w4a8"
MLP = ("gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def quantize_weight(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization over groups of `group_size` input columns; returns (int8 q, fp32 scales)."""
    out_f, in_f = w.shape
    g = group_size if in_f % group_size == 0 else in_f
    qmax = 2 ** (bits - 1) - 1
    wg = w.reshape(out_f, in_f // g, g)
    scale = (wg.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-8)
    q = torch.round(wg / scale).clamp(-qmax - 1, qmax).to(torch.int8)
    return q.reshape(out_f, in_f), scale.squeeze(-1).float()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_f, in_f = q.shape
    g = in_f // scale.shape[1]
    return (q.float().reshape(out_f, -1, g) * scale[..., None]).reshape(out_f, in_f)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    u = (q + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    lo, hi = (p & 0x0F).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], -1).reshape(p.shape[0], -1)


def _bits_for(name: str, cfg) -> int | None:
    leaf = name.rsplit(".", 1)[-1]
    return cfg.mlp_bits if leaf in MLP else cfg.attn_bits if leaf in ATTN else None


def quantize_model(model, qcfg) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    tensors, err, n_lin, fp_bytes, q_bytes = {}, 0.0, 0, 0, 0
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, p in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        bits = _bits_for(mod, qcfg) if mod in linear_names and name.endswith(".weight") else None
        if bits is None:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            tensors[name] = p.contiguous()
            continue
        q, s = quantize_weight(p, bits, qcfg.group_size if bits == 4 else p.shape[1])
        tensors[f"{mod}.qweight"] = pack_int4(q) if bits == 4 else q
        tensors[f"{mod}.scales"] = s
        err += ((dequantize_weight(q, s) - p).norm() / p.norm()).item()
        n_lin += 1
        fp_bytes += p.numel() * 4
        q_bytes += tensors[f"{mod}.qweight"].numel() + s.numel() * 4
    return tensors, {"quantized_linears": n_lin, "weight_rel_error": err / max(1, n_lin),
                     "linear_bytes_fp32": fp_bytes, "linear_bytes_quantized": q_bytes,
                     "compression": fp_bytes / max(1, q_bytes)}


def act_quant_hook(module, args):
    """Per-token symmetric int8 fake quantization of a Linear layer's input."""
    x = args[0]
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
    return (torch.round(x / s).clamp(-128, 127) * s,)


def load_quantized(path: str | Path):
    """Rebuild the fp32 model from int weights (dequantized) with int8 activation quantization hooks."""
    config = AutoConfig.from_pretrained(path)
    qc = config.quantization_config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).float().eval()
    tensors = load_file(str(Path(path) / "model.safetensors"))
    state = {k: v for k, v in tensors.items() if not k.endswith((".qweight", ".scales"))}
    for name, module in model.named_modules():
        if f"{name}.qweight" in tensors:
            q = tensors[f"{name}.qweight"]
            q = unpack_int4(q) if q.dtype == torch.uint8 else q
            state[f"{name}.weight"] = dequantize_weight(q, tensors[f"{name}.scales"])
            if qc.get("act_bits") == 8:
                module.register_forward_pre_hook(act_quant_hook)
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model, AutoTokenizer.from_pretrained(path)


def is_quantized(path: str | Path) -> bool:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("quantization_config", {}).get("quant_method") == METHOD


def load_any(path: str | Path):
    return load_quantized(path) if is_quantized(path) else load_checkpoint(path)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    model, tok = load_checkpoint(inputs["opd"])
    tensors, stats = quantize_model(model, cfg.quantize)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "quant_method": METHOD})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": METHOD, **cfg.quantize.model_dump()}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(out)
    stats["disk_bytes"] = (out / "model.safetensors").stat().st_size
    return {"metrics": stats}
