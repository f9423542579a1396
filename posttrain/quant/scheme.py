"""What W4A8 quantizes and how (the quantize stage's export and the W4A8 rollouts share it): int4 groups for the MLP
(a dense model) or the routed experts (GLM-5), int8 channels for attention and GLM-5's dense MLP and shared expert."""
from __future__ import annotations

import re

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from posttrain.checkpoint_rules import group_size_problem, module_pattern
from posttrain.config import QuantizeConfig
from posttrain.models.glm5 import is_glm5

MLP = ("gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # GLM-5's latent attention
EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj$")
SCALE_DTYPE = torch.bfloat16  # scales and the unquantized tensors (embeddings, norms) are stored in bf16


def scheme(qcfg: QuantizeConfig, glm5: bool = False) -> QuantizationConfig:
    """A dense model: int4 groups for the MLP, int8 channels for attention. GLM-5 as it deploys: int4 groups for
    the routed experts (nearly all its weights), int8 channels for attention, the dense MLP and the shared expert;
    its DSA indexer stays 16-bit beside the router (small, and selection is sensitive)."""
    act = QuantizationArgs(num_bits=qcfg.act_bits, type="int", symmetric=True, strategy="token", dynamic=True)
    w4 = QuantizationArgs(num_bits=qcfg.mlp_bits, type="int", symmetric=True, strategy="group",
                          group_size=qcfg.group_size)
    w8 = QuantizationArgs(num_bits=qcfg.attn_bits, type="int", symmetric=True, strategy="channel")
    int4 = r"mlp\.experts\.\d+\.(gate|up|down)_proj$" if glm5 else r"mlp\.(gate|up|down)_proj$"
    kept = "|".join(map(str, sorted(set(qcfg.int8_layers))))
    if glm5:
        groups = {
            "experts_w4a8": QuantizationScheme(targets=[_layers(int4, kept, False)],
                                               input_activations=act, format="pack-quantized", weights=w4),
            "dense_w8a8": QuantizationScheme(
                targets=[r"re:.*self_attn\.(" + "|".join(MLA) + ")$",
                         r"re:.*mlp\.(shared_experts\.)?(gate|up|down)_proj$"],
                input_activations=act, format="int-quantized", weights=w8)}
    else:
        groups = {
            "mlp_w4a8": QuantizationScheme(targets=[_layers(int4, kept, False)], input_activations=act,
                                           format="pack-quantized", weights=w4),
            "attn_w8a8": QuantizationScheme(targets=[r"re:.*self_attn\.(q|k|v|o)_proj$"], input_activations=act,
                                            format="int-quantized", weights=w8)}
    if kept:  # quantize.int8_layers: their int4 targets at int8 per channel
        groups["int8_layers_w8a8"] = QuantizationScheme(targets=[_layers(int4, kept, True)], input_activations=act,
                                                        format="int-quantized", weights=w8)
    return QuantizationConfig(config_groups=groups, ignore=["lm_head", r"re:mtp\..*", r"re:.*indexer\..*"],
                              format="mixed-precision")


def _layers(leaf: str, kept: str, inside: bool) -> str:
    """A compressed-tensors target for `leaf` in the decoder layers numbered `kept` (inside) or in every other one."""
    if not kept:
        return "re:.*" + leaf
    return rf"re:.*layers\.({kept})\.{leaf}" if inside else rf"re:.*layers\.(?!({kept})\.)\d+\.{leaf}"


def targets(model, qcfg: QuantizeConfig) -> dict[str, tuple[torch.nn.Linear, int, int]]:
    """Quantized Linear name -> (module, bits, group size), as `scheme` says; refuses a group size that does not
    divide (the rule checked against a checkpoint before the first stage: posttrain.checkpoint_rules). A GLM-5
    model's experts must be unfused first (posttrain.models.moe.unfuse_experts)."""
    glm, out, grouped = is_glm5(model), {}, {}
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        # the MTP layer only drafts (every token is checked by the quantized model): it stays in 16-bit
        if not isinstance(m, torch.nn.Linear) or name.startswith("mtp.") or ".indexer." in name:
            continue
        if glm:
            if EXPERT.search(name):
                bits, g = qcfg.mlp_bits, qcfg.group_size
            elif leaf in MLA + MLP:
                bits, g = qcfg.attn_bits, m.in_features
            else:
                continue
        elif leaf in MLP + ATTN:
            bits = qcfg.mlp_bits if leaf in MLP else qcfg.attn_bits
            g = qcfg.group_size if leaf in MLP else m.in_features
        else:
            continue
        if bits == qcfg.mlp_bits and _layer_of(name) in qcfg.int8_layers:
            bits, g = qcfg.attn_bits, m.in_features
        if bits == qcfg.mlp_bits:  # int4 groups (int8 is per channel: a group of every input column)
            grouped.setdefault(module_pattern(name), m.in_features)
        out[name] = (m, bits, g)
    if problem := group_size_problem(qcfg.group_size, grouped):
        raise ValueError(f"quantize.group_size={qcfg.group_size} {problem}")
    n = model.config.num_hidden_layers
    if beyond := sorted(i for i in set(qcfg.int8_layers) if i >= n):
        raise ValueError(f"quantize.int8_layers: {beyond} are not layers of this model (it has {n}: 0-{n - 1})")
    return out


def _layer_of(name: str) -> int | None:
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None
