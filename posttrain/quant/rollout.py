"""W4A8 rollouts (`rl.rollout_dtype: w4a8`): the rollout workers generate from the policy as the quantize stage
deploys it (int4 groups for the MLP or the routed experts, int8 channels for attention, int8 activations per token,
`posttrain.quant.scheme`), while the trainer stays fp32: the precision gap GLM-5's rollouts have and the
importance-sampling ratio (and routing replay) must absorb. Rounded to nearest, not GPTQ: a worker quantizes every
policy the trainer pushes, with no calibration data at hand."""
from __future__ import annotations

import copy

import torch

from posttrain.config import QuantizeConfig
from posttrain.models import moe
from posttrain.quant.gptq import rtn
from posttrain.quant.int_experts import group_int_experts
from posttrain.quant.int_matmul import IntLinear
from posttrain.quant.scheme import SCALE_DTYPE, targets


def w4a8_copy(model: torch.nn.Module, qcfg: QuantizeConfig | None = None) -> torch.nn.Module:
    """A copy of `model` whose quantize-stage targets are `IntLinear`s (integer matmuls) holding their weights
    rounded to nearest; embeddings, norms, routers and the DSA indexer stay as they are."""
    qcfg = qcfg or QuantizeConfig()
    out = copy.deepcopy(model).eval()
    moe.unfuse_experts(out)  # GLM-5's routed experts: one Linear each, as the export quantizes them
    # int4 groups of quantize.group_size, halved until they divide every layer's input width (a small model's)
    widths, g = {m.in_features for m in out.modules() if isinstance(m, torch.nn.Linear)}, qcfg.group_size
    while g > 1 and any(w % g for w in widths):
        g //= 2
    qcfg = qcfg.model_copy(update={"group_size": g})
    with torch.no_grad():
        for name, (m, bits, group) in targets(out, qcfg).items():
            q, scales = rtn(m.weight, bits, group, SCALE_DTYPE)
            out.set_submodule(name, IntLinear(q, scales, qcfg.act_bits, bits).to(m.weight.device))
    group_int_experts(out)
    return out
