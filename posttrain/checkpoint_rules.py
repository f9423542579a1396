"""The settings a checkpoint's own shapes decide, checked against base.init_from's config.json before the first stage
(`posttrain.stages.base.check_checkpoint`) instead of in the stage that reads them, hours later.

One function per rule: `rule(cfg, hf, where) -> list[str]`, `hf` the checkpoint's config as transformers parses its
config.json (`AutoConfig.from_pretrained`: JSON only, no weights; the class fills the defaults the stages see), `where`
the file or checkpoint named in the message. Each message is `key: where: what is wrong; allowed: ...`. The stages
call the same functions where they meet the rule (ramp: attention and DSA; quantize: the group size; sft: tool calls),
or the check calls the stage's own (the megatron engine's layout checks), so each rule lives in one place.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import environments
from posttrain.chat import chat_format
from posttrain.config import DSAConfig
from posttrain.engines import registry
from posttrain.models.head import _SCALING

if TYPE_CHECKING:
    from posttrain.config import PipelineConfig, RampStage

GLM5_TYPES = ("glm_moe_dsa", "deepseek_v32")  # as posttrain.models.glm5.is_glm5
GLM5_ATTENTION = ("sdpa", "eager", "dsa")     # the implementations that build the full 4D mask GLM-5's indexer reads


def model_type(init_from: str) -> str:
    """config.json's model_type of a local checkpoint folder; '' where there is none here (yet: `checkpoint:<name>`
    before it is resolved, a remote run's path)."""
    if not init_from:
        return ""
    try:
        return str(json.loads((Path(init_from) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _glm5(hf) -> bool:
    return getattr(hf, "model_type", "") in GLM5_TYPES


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def ramp_attention(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """ramp.attention: GLM-5's DSA indexer selects keys through a full 4D mask, which only sdpa and eager build (dsa
    trains that indexer); dsa on a dense checkpoint needs an engine that trains posttrain's own indexers."""
    a, errors = cfg.ramp.attention, []
    if _glm5(hf) and a not in GLM5_ATTENTION:
        errors.append(f"ramp.attention: {where}: {a!r} with a GLM-5 checkpoint (model_type {hf.model_type}): its DSA "
                      f"indexer selects keys through a full 4D mask, which only sdpa and eager build; allowed: "
                      f"{', '.join(GLM5_ATTENTION)} (left unset, a local run takes sdpa for a GLM-5 checkpoint)")
    name = cfg.runtime.train_engine
    if a == "dsa" and not _glm5(hf) and not registry.supports("train", name, registry.OWN_INDEXERS):
        errors.append(f"ramp.attention: {where}: dsa on a dense checkpoint (model_type {hf.model_type}) adds "
                      f"posttrain's own indexers, which the {name} engine does not train "
                      f"({registry.names('train', registry.OWN_INDEXERS)} do); allowed with runtime.train_engine "
                      f"{name}: a dense attention (sdpa, packed_sdpa, flash_attention_2)")
    return errors


def ramp_dsa(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """ramp.dsa with ramp.attention dsa: GLM-5 brings its indexers, laid out by its indexer_types (ramp.dsa's layout
    settings would be ignored); a dense checkpoint gets posttrain's own, which need its layers and full-head RoPE."""
    r = cfg.ramp
    if r.attention != "dsa":
        return []
    if _glm5(hf):
        default = DSAConfig().model_dump()
        return [f"ramp.dsa.{k}: {where}: GLM-5's own indexers are laid out by the checkpoint's indexer_types "
                f"({', '.join(getattr(hf, 'indexer_types', None) or ['full'] * hf.num_hidden_layers)}), not by "
                f"ramp.dsa.{k} (got {getattr(r.dsa, k)!r}); allowed: unset (the default {default[k]!r})"
                for k in ("index_share", "heads", "own_indexer") if getattr(r.dsa, k) != default[k]]
    errors, n = [], hf.num_hidden_layers
    if bad := [i for i in r.dsa.own_indexer if i >= n]:
        errors.append(f"ramp.dsa.own_indexer: {where}: layers {bad} are past the checkpoint's num_hidden_layers {n} "
                      f"(got {r.dsa.own_indexer}); allowed: layer indices 0 to {n - 1}")
    partial = getattr(hf, "partial_rotary_factor", None)
    if partial not in (None, 1, 1.0):
        errors.append(f"ramp.attention: {where}: dsa's indexer rotates full heads, and the checkpoint rotates "
                      f"partial_rotary_factor {partial} of each; allowed: a dense attention (sdpa, packed_sdpa)")
    return errors


def rung_config(config, stage: RampStage):
    """A copy of a model's config with a ramp rung's RoPE settings and length (what the ramp trains it at)."""
    from transformers import AutoConfig  # transformers at first use: the CLI's checks import this module
    config = AutoConfig.for_model(**config.to_dict())
    config.rope_parameters = {"rope_type": "default", **dict(stage.rope_scaling), "rope_theta": stage.rope_theta}
    config.max_position_embeddings = stage.seq_len
    return config


def ramp_rope(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """ramp.stages.N.rope_scaling: the RoPE each rung rebuilds the checkpoint with (`rung_config`) must be one
    transformers builds for the checkpoint's class."""
    stages = [(k, st) for k, st in enumerate(cfg.ramp.stages) if st.rope_scaling]
    if not stages:
        return []
    # transformers: at first use (the CLI's checks import this module)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    errors = []
    for k, st in stages:
        config = rung_config(hf, st)
        kind = config.rope_parameters.get("rope_type", "default")
        try:
            if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
                raise KeyError(f"unknown rope_type {kind!r}")
            config.validate_rope()
        except (KeyError, ValueError, TypeError) as e:
            why = e.args[0] if e.args else e
            errors.append(f"ramp.stages.{k}.rope_scaling: {where}: {why} (got {st.rope_scaling}); "
                          f"allowed: none (default RoPE at the stage's rope_theta), or a rope_type of "
                          f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))} with the keys it needs")
    return errors


def int4_widths(hf) -> dict[str, tuple[str, int]]:
    """The Linears quantize stores as int4 groups (`posttrain.stages.quantize.targets`), from the config: module pattern
    -> (config key, input width). GLM-5's routed experts (its attention, dense MLP and shared expert are int8 per
    channel); a dense model's MLP, and a DeepSeek-style MoE's experts and shared experts beside it."""
    h, moe = hf.hidden_size, getattr(hf, "moe_intermediate_size", None)
    experts = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", None)
    if _glm5(hf):
        return {"mlp.experts.*.gate_proj/up_proj": ("hidden_size", h),
                "mlp.experts.*.down_proj": ("moe_intermediate_size", moe)} if experts else {}
    out = {"mlp.gate_proj/up_proj": ("hidden_size", h)}
    if getattr(hf, "intermediate_size", None):
        out["mlp.down_proj"] = ("intermediate_size", hf.intermediate_size)
    if experts and moe:
        out["mlp.experts.*.down_proj"] = ("moe_intermediate_size", moe)
        if shared := getattr(hf, "n_shared_experts", None):
            out["mlp.shared_experts.down_proj"] = ("moe_intermediate_size x n_shared_experts", moe * shared)
        if shared := getattr(hf, "shared_expert_intermediate_size", None):
            out["mlp.shared_expert.down_proj"] = ("shared_expert_intermediate_size", shared)
    return out


def group_size_problem(g: int, widths: dict[str, int]) -> str | None:
    """quantize.group_size against the input widths of the Linears quantized in int4 groups (what -> columns): int4
    weights share a scale per group of input columns, so a group must divide every width. None where it does."""
    bad = {what: w for what, w in widths.items() if w % g}
    if not bad:
        return None
    common = math.gcd(*widths.values())
    columns = "; ".join(f"{what}'s {w} input columns" for what, w in bad.items())
    return f"does not divide {columns}; allowed: a divisor of {common}: {_divisors(common)}"


def quantize_group_size(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """quantize.group_size divides every int4 Linear's input width (rl.rollout_dtype w4a8 halves it to fit instead)."""
    g, widths = cfg.quantize.group_size, int4_widths(hf)
    problem = group_size_problem(g, {what: w for what, (_, w) in widths.items()})
    if not problem:
        return []
    keys = ", ".join(dict.fromkeys(f"{key} {w}" for key, w in widths.values()))
    return [f"quantize.group_size: {where}: {g} {problem} (the int4 widths: {keys})"]


def quantize_int8_layers(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """quantize.int8_layers names decoder layers the checkpoint has."""
    n = hf.num_hidden_layers
    if beyond := sorted(i for i in set(cfg.quantize.int8_layers) if i >= n):
        return [f"quantize.int8_layers: {where}: {beyond} are not layers of this model; allowed: 0 to {n - 1}"]
    return []


def engine_layout(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """The train engine's own checks of its split over ranks against the checkpoint (posttrain.engines.registry:
    megatron's tp, pp, ep, the model types it maps)."""
    ref = registry.spec("train", cfg.runtime.train_engine).checkpoint_rules
    return registry.load(ref)(cfg, hf, where) if ref else []


def routing_replay(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """rl.routing_replay replays a mixture-of-experts policy's routes: the checkpoint needs routers (DeepSeek-V3-style
    experts with an expert bias: GLM-5, DeepSeek-V3)."""
    if getattr(hf, "n_routed_experts", None):
        return []
    r = cfg.rl
    keys = (["rl.routing_replay"] if r.routing_replay else []) + \
        [f"rl.per_domain.{d}.routing_replay" for d in r.domains if r.for_domain(d).routing_replay
         and "routing_replay" in r.per_domain.get(d, {})]
    return [f"{key}: {where}: needs a mixture-of-experts policy, and the checkpoint (model_type {hf.model_type}) has "
            f"no routed experts (n_routed_experts); allowed: false" for key in keys[:1]]


def mtp_head(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """mtp.depth: the draft layer shares the output head, so the logits must be the last hidden state times the output
    embeddings (`posttrain.models.mtp.install`): no logit scaling in the config."""
    scaled = {k: getattr(hf, k) for k in _SCALING if getattr(hf, k, None) not in (None, 1, 1.0)}
    if not cfg.mtp.depth or not scaled:
        return []
    return [f"mtp.depth: {where}: the draft layer shares the output head, and the checkpoint scales its logits "
            f"({', '.join(f'{k} {v}' for k, v in scaled.items())}); allowed: 0"]


def moe_shape(cfg: PipelineConfig, hf, where: str) -> list[str]:
    """A GLM-5 / DeepSeek-V3 router that could not pick its experts: more per token than there are, more groups kept
    than there are (the first forward would fail, after curate and base)."""
    e, k = getattr(hf, "n_routed_experts", None), getattr(hf, "num_experts_per_tok", None)
    if not e or not k:
        return []
    errors = []
    if k > e:
        errors.append(f"base.init_from: {where}: num_experts_per_tok {k} > n_routed_experts {e}; allowed: 1 to {e}")
    groups, kept = getattr(hf, "n_group", None) or 1, getattr(hf, "topk_group", None) or 1
    if kept > groups:
        errors.append(f"base.init_from: {where}: topk_group {kept} > n_group {groups}; allowed: 1 to {groups}")
    return errors


def chat_tools(cfg: PipelineConfig, tok, where: str) -> list[str]:
    """A domain that calls tools needs a template that renders them (sft's demonstrations, RL's rollouts)."""

    tooled = [d for d in environments.names(cfg.world.environments) if hasattr(environments.get(d), "open_workspace")]
    if not tooled or chat_format(tok).tool_format != "none":
        return []
    return [f"base.chat_template: {where} renders no tool calls, and the {', '.join(tooled)} domain calls tools: pass "
            f"--set base.chat_template=<a .jinja file that renders `tool_calls`>, e.g. "
            f"configs/templates/chatml-tools.jinja for a ChatML model"]


RULES = (ramp_attention, ramp_dsa, ramp_rope, quantize_group_size, quantize_int8_layers, engine_layout,
         routing_replay, mtp_head, moe_shape)


def check(cfg: PipelineConfig, path: str | Path) -> list[str]:
    """Every rule against the checkpoint folder `path` (already a loadable one: `preset.check_folder`)."""
    from transformers import AutoConfig  # transformers: at first use (the CLI's checks import this module)
    hf = AutoConfig.from_pretrained(path)
    where = str(Path(path) / "config.json")
    return [e for rule in RULES for e in rule(cfg, hf, where)]


def stage_check(cfg: PipelineConfig, hf, where: str, *rules) -> None:
    """In a stage: the rules it meets, on the model it loaded, as one ValueError."""
    if errors := [e for rule in rules for e in rule(cfg, hf, where)]:
        raise ValueError("\n  ".join(errors))


def module_pattern(name: str) -> str:
    """A module name with its layer and expert numbers as `*` (one line for the same Linear of every layer)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)
