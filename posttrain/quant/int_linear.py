"""Running a W4A8 compressed-tensors checkpoint on CPU with integer matmuls.

Each quantized Linear becomes an `IntLinear`: activations are quantized per token to int8 on the fly,
multiplied with the int8 (or int4, held unpacked as int8) weights by `torch._int_mm` (int8 x int8 -> int32),
and rescaled per group. transformers' own compressed-tensors loader only decompresses to float weights,
and torchao's int4 paths need CUDA/XPU kernels: this is the CPU path our evaluation runs on. On CUDA, 4-bit
weights go through the packed W4A8 Triton kernel (`kernels.w4a8`) instead."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kernels import use_triton
from posttrain.models import dsa, glm5, moe, mtp


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32; CUDA's `_int_mm` wants more than 16 rows, so a decode step's few rows are padded."""
    if a.is_cuda and a.size(0) <= 16:
        return torch._int_mm(torch.nn.functional.pad(a, (0, 0, 0, 17 - a.size(0))), b)[:a.size(0)]
    return torch._int_mm(a, b)


class IntLinear(torch.nn.Module):
    """y = sum over groups g of (x_q[:, g] @ W_q[g]^T) * s_w[g] * s_x; x_q per-token int8."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, act_bits: int = 8, weight_bits: int = 8):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        self.act_max = 2 ** (act_bits - 1) - 1
        self.register_buffer("qweight_t", q.to(torch.int8).t().contiguous())   # [in, out]
        self.register_buffer("scales_t", scales.float().t().contiguous())      # [groups, out]
        self.kernel_fits = weight_bits == 4 and act_bits == 8 and self.group_size % 16 == 0
        # the Triton kernel's weights by layout, made where each is first used (a decode step's few rows and a
        # prefill's many take different layouts), 4 bits a weight each beside the int8 copy the CPU path reads
        self._packed: dict[str, torch.Tensor] = {}
        self._scales: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel_fits and use_triton(x2):
            from kernels.w4a8 import default_config, kernel_layout, w4a8_linear
            cfg = default_config(x2.size(0), self.in_features, self.group_size)
            packed = self._packed.get(cfg["layout"])
            if packed is None or packed.device != x2.device:  # each layout the kernel uses, made once
                nk = pack_to_int32(self.qweight_t.t().to(x2.device), 4)
                packed = self._packed[cfg["layout"]] = kernel_layout(nk, cfg["layout"])
                self._scales = self.scales_t.t().contiguous().to(x2.device)
            y = w4a8_linear(x2, packed, self._scales, config=cfg)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        x2 = x2.float()
        sx = (x2.abs().amax(-1, keepdim=True) / self.act_max).clamp(min=1e-8)
        xq = torch.round(x2 / sx).clamp(-self.act_max - 1, self.act_max).to(torch.int8)
        g = self.group_size
        if g == self.in_features:
            acc = _int_mm(xq, self.qweight_t).float() * self.scales_t[0]
        else:
            acc = sum(_int_mm(xq[:, a:a + g].contiguous(), self.qweight_t[a:a + g]).float() * self.scales_t[k]
                      for k, a in enumerate(range(0, self.in_features, g)))
        return (acc * sx).to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"


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
    model = mtp.restore(dsa.restore(AutoModelForCausalLM.from_config(config, dtype=torch.float32))).eval()
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
    from posttrain.quant.int_experts import group_int_experts
    group_int_experts(model)  # routed experts in grouped launches where the Triton kernel runs
    return model, AutoTokenizer.from_pretrained(path)


def is_compressed(path: str | Path) -> bool:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("quantization_config", {}).get("quant_method") == "compressed-tensors"


def load_any(path: str | Path):
    """A checkpoint folder, plain or compressed-tensors W4A8, as (model, tokenizer)."""
    from posttrain.models.preset import load_checkpoint
    return load_compressed(path) if is_compressed(path) else load_checkpoint(path)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold in memory (tied tensors once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values())
