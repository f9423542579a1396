"""Typed pipeline configuration: YAML profiles under configs/, `--set a.b=c` overrides, a digest."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = ROOT / "configs"


class ConfigError(ValueError):
    """A profile or override is wrong; the message names the key and the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorldConfig(_Strict):
    """The generated task world (see environments/)."""
    n_train: int = 3000
    n_val: int = 64
    n_test: int = 128
    max_operand: int = 9
    n_ops: int = 2
    agentic_numbers: int = 3
    # your own environments: name -> module with generate() and verify() (see README)
    environments: dict[str, str] = Field(default_factory=dict)

    def knobs(self) -> dict:
        """The difficulty knobs every generator receives (each takes what it knows, ignores the rest)."""
        return self.model_dump(exclude={"n_train", "n_val", "n_test", "environments"})


class CurateConfig(_Strict):
    inputs: list[str] = Field(default_factory=list)  # JSONL(.gz) / Parquet files or globs; empty: generated
    text_field: str = "text"
    id_field: str = "id"
    source_field: str = "source"
    raw_docs: int = 6000
    shingle_size: int = 5                # word/punct tokens per MinHash shingle
    near_dup_threshold: float = 0.6      # estimated Jaccard at or above which two documents are duplicates
    num_perm: int = 128
    min_chars: int = 20
    max_chars: int = 20000
    min_alpha_ratio: float = 0.3
    max_symbol_ratio: float = 0.1
    repeat_ngram: int = 5                # Gopher-style: share of characters in repeated word n-grams
    max_repeat_share: float = 0.5
    max_boilerplate_share: float = 0.5   # share of sentences that are cookie banners, "click here", ...
    mixture: dict[str, float] = Field(default_factory=dict)  # source -> pretrain weight (2: twice, 0.5: half)
    on_bad_row: Literal["fail", "quarantine"] = "quarantine"


class TokenizerConfig(_Strict):
    vocab_size: int = 512


class ModelConfig(_Strict):
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None      # grouped-query attention; None: one key/value head per query head
    intermediate_size: int = 384
    rope_theta: float = 10000.0
    max_position_embeddings: int = 128


class TrainConfig(_Strict):
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0


class BaseConfig(TrainConfig):
    init_from: str = ""  # a local Hugging Face checkpoint dir; empty: build and pretrain the tiny preset


class RampStage(_Strict):
    seq_len: int
    tokens: int                  # training-token budget; steps = tokens / (batch_size * grad_accum * seq_len)
    lr: float = 1e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1
    rope_theta: float            # RoPE base for this stage (raised with the length: "ABF")
    rope_scaling: dict[str, str | float] = Field(default_factory=dict)  # e.g. {rope_type: yarn, factor: 4.0}
    long_share: float = Field(0.3, ge=0, le=1)  # share of rows holding long-context documents


class RampConfig(_Strict):
    batch_size: int = 8          # rows of seq_len tokens per micro-batch
    grad_accum: int = 1
    weight_decay: float = 0.1
    mask_documents: bool = True  # attention stays inside each packed document; positions restart
    activation_checkpointing: bool = False
    attention: str = "sdpa"      # a transformers attention implementation or one from posttrain.attention.register
    long_docs: int = 2000        # distinct long-context documents per stage, lengths spread up to seq_len
    long_loss_weight: float = 8.0  # weight of a long document's answer tokens against a pretraining token
    stages: list[RampStage] = Field(default_factory=lambda: [
        RampStage(seq_len=256, tokens=245_760, rope_theta=20000.0),
        RampStage(seq_len=512, tokens=491_520, rope_theta=40000.0, long_share=0.5)])

    @model_validator(mode="after")
    def _ladder(self):
        lens = [s.seq_len for s in self.stages]
        if not lens or lens != sorted(set(lens)):
            raise ValueError(f"stages must have strictly increasing seq_len (got {lens})")
        for s in self.stages:
            if s.tokens < self.batch_size * self.grad_accum * s.seq_len:
                raise ValueError(f"stage {s.seq_len}: tokens {s.tokens} is less than one step "
                                 f"({self.batch_size} x {self.grad_accum} x {s.seq_len})")
        return self

    def steps(self, stage: RampStage) -> int:
        return stage.tokens // (self.batch_size * self.grad_accum * stage.seq_len)


class SFTConfig(TrainConfig):
    steps: int = 1500
    seq_len: int = 512
    lr: float = 2e-3
    nothink_share: float = 0.25
    preserve_thinking_share: float = 0.5
    # share of demonstrations from a lazy teacher (each environment's `shortcut`: no worked steps, a
    # forgotten constraint): imperfect SFT data, as real data is, which RL against the verifier repairs
    shortcut_share: float = 0.0
    grad_accum: int = 1           # micro-batches per optimizer step (each batch_size rows)
    workers: int = 1              # Ray Train data-parallel workers (each takes rows rank::workers)
    checkpoint_every: int = 100   # steps between resumable checkpoints (weights, optimizer, RNG, step)
    packing: bool = False         # rows of seq_len packed with whole conversations (batch_size = rows per step);
                                  # off: batches of batch_size conversations, bucketed by length


class RLConfig(_Strict):
    """One specialist's RL. `per_domain` overrides any field for one specialist (e.g. agentic: ppo)."""
    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8                  # samples per prompt; GRPO normalises rewards within a group
    lr: float = 3e-5
    temperature: float = 1.0
    max_new_tokens: int = 48
    max_turns: int = 3
    clip_eps: float = 0.2                # PPO ratio clip (ratio = current / behaviour policy)
    is_lower: float = 0.5                # double-sided importance sampling: a token whose ratio leaves
    is_upper: float = 2.0                # [is_lower, is_upper] is masked from the loss
    loss_agg: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0                 # KL to the reference (the sft checkpoint); 0: no reference model
    entropy_coef: float = 0.0
    max_staleness: int = 1               # k: samples more than k policy versions old are dropped; 0 = synchronous
    rollout_workers: int = 1
    worker_cpus: float = 0.25            # Ray CPUs each rollout worker reserves
    critic_lr: float = 3e-4              # ppo: the value model (the policy's backbone with a scalar head)
    gae_gamma: float = 1.0
    gae_lambda: float = 0.95
    value_clip: float = 0.2
    ppo_epochs: int = 1                  # passes over each rollout batch
    micro_batch_cells: int = 2048        # completion tokens (padding included) per length-sorted micro-batch
    val_every: int = 10                  # greedy validation accuracy every n steps (0: only before and after)
    checkpoint_every: int = 10
    per_domain: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if not self.is_lower < 1 < self.is_upper:
            raise ValueError(f"rl.is_lower < 1 < rl.is_upper must hold (got {self.is_lower}, {self.is_upper})")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError("rl.group_size must be at least 2 for grpo (its baseline is the group mean)")
        if self.max_staleness < 0 or self.rollout_workers < 1:
            raise ValueError("rl.max_staleness must be >= 0 and rl.rollout_workers >= 1")
        for domain in self.per_domain:
            self.for_domain(domain)  # an override naming an unknown key or a bad value fails here, with its name
        return self

    def for_domain(self, domain: str) -> "RLConfig":
        base = self.model_dump(exclude={"per_domain"})
        try:
            return RLConfig.model_validate({**base, **self.per_domain.get(domain, {})})
        except ValidationError as e:
            raise ValueError("; ".join(
                f"rl.per_domain.{domain}.{'.'.join(map(str, x['loc']))}: "
                + ("unknown key" if x["type"] == "extra_forbidden" else x["msg"]) for x in e.errors())) from None


class OPDConfig(_Strict):
    """Multi-teacher on-policy distillation: the student samples, each prompt's teacher (the specialist of
    its domain, unless `route` says otherwise) scores the student's own tokens."""
    student: Literal["sft", "rl-reasoning", "rl-agentic", "rl-general"] = "sft"
    steps: int = 60
    prompts_per_step: int = 24           # per step, split evenly across the domains
    lr: float = 5e-5
    temperature: float = 1.0
    max_new_tokens: int = 48
    loss: Literal["sampled", "topk", "full"] = "sampled"  # sampled: only teacher logprobs of sampled tokens
    top_k: int = 16
    reward_weight: float = 0.0           # > 0 mixes the task reward in (reward minus its domain's batch mean)
    route: dict[str, str] = Field(default_factory=dict)   # prompt domain -> teacher domain (default: itself)
    max_staleness: int = 1
    teacher_cpus: float = 0.2            # Ray CPUs each teacher actor reserves
    val_every: int = 10
    checkpoint_every: int = 10

    @model_validator(mode="after")
    def _check(self) -> "OPDConfig":
        bad = {k: v for k, v in self.route.items() if v not in ("reasoning", "agentic", "general")}
        if bad:
            raise ValueError(f"opd.route: teachers are the specialists reasoning, agentic, general (got {bad})")
        if self.prompts_per_step < 1 or self.top_k < 1 or self.max_staleness < 0:
            raise ValueError("opd.prompts_per_step and opd.top_k must be >= 1, opd.max_staleness >= 0")
        return self


class CrossStageConfig(_Strict):
    """The GLM-5 recipe (workflows/cross_stage.py): sequential RL stages (reasoning, then agentic, then general),
    each distilling from the earlier stages' checkpoints on their domains' prompts; and the same stages
    without distillation as the baseline. RL settings are `rl`'s (with its per-domain overrides)."""
    distill_prompts_per_step: int = 16   # earlier domains' prompts per step, split evenly
    distill_coef: float = 1.0
    loss: Literal["sampled", "topk", "full"] = "sampled"
    eval_n: int = 0                      # test tasks per domain in the comparison (0: the whole test split)


class QuantizeConfig(_Strict):
    """W4A8: int4 group-wise weights for the MLP blocks, int8 per-channel for attention, int8 per-token
    activations, exported as compressed-tensors."""
    mlp_bits: Literal[4] = 4
    attn_bits: Literal[8] = 8
    act_bits: Literal[8] = 8
    group_size: int = 128                # int4 weights share a scale per group of input columns
    method: Literal["gptq", "rtn"] = "gptq"  # GPTQ: error-compensating rounding on calibration activations
    calib_samples: int = 128             # curated SFT conversations the calibration activations come from
    calib_seq_len: int = 512
    dampening: float = 0.01              # GPTQ: share of the mean Hessian diagonal added before inverting


class EvalConfig(_Strict):
    n_per_suite: int = 64                # long-context tasks per length (domain suites: the whole test split)
    max_new_tokens: int = 48
    batch_size: int = 64
    samples: int = 4                     # sampled answers per task for pass@k (0: greedy only)
    temperature: float = 0.6             # for the sampled answers

    def batch_size_at(self, length: int) -> int:
        """Prompts per batch at a context length: attention scores are batch x heads x length^2, so
        `batch_size` holds up to 512 tokens and shrinks beyond."""
        return max(1, min(self.batch_size, self.batch_size * 512 // length))


class GatesConfig(_Strict):
    """Regression gates on a checkpoint's greedy test scores. A failing gate fails the pipeline run and
    the model is not registered. Suite "*" stands for every suite."""
    checkpoint: str = "quantized"
    min: dict[str, float] = {}           # suite -> lowest acceptable score
    max_drop: dict[str, float] = {}      # suite -> most it may score below `baseline`
    baseline: str = "generalist"


class RuntimeConfig(_Strict):
    ray_num_cpus: int = 2
    torch_threads: int = 2
    object_store_mb: int = 256


class PipelineConfig(_Strict):
    profile: str = "tiny"
    seed: int = 0
    world: WorldConfig = WorldConfig()
    curate: CurateConfig = CurateConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    base: BaseConfig = BaseConfig()
    ramp: RampConfig = RampConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    opd: OPDConfig = OPDConfig()
    cross_stage: CrossStageConfig = CrossStageConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    eval: EvalConfig = EvalConfig()
    gates: GatesConfig = GatesConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    registered_model: str = "posttrain-tiny"

    def digest(self, *sections: str) -> str:
        """sha256 of the whole config, or of only the named sections ("eval" or a key path "eval.batch_size")."""
        data = self.model_dump(mode="json")
        if sections:
            data = {k: _at(data, k) for k in sections}
        else:
            data.pop("runtime")  # where it runs does not change what it computes
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def eval_lengths(self) -> list[int]:
        """The base model's context length and every ramp stage's: long_context is scored at each."""
        return sorted({self.model.max_position_embeddings, *(s.seq_len for s in self.ramp.stages)})


def _at(data: dict, path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict, overrides: list[str], source: str = "--set") -> dict:
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ConfigError(f"{source}: {key!r}: {p!r} is not a section")
            node = node[p]
        node[parts[-1]] = _parse_value(raw)
    return data


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid config in {source}:"]
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def profile_path(profile: str) -> Path:
    p = Path(profile)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.exists():
        known = sorted(x.stem for x in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {profile!r}: no file {path} (known: {', '.join(known)})")
    return path


def load_config(profile: str = "tiny", overrides: list[str] | None = None) -> PipelineConfig:
    path = profile_path(profile)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    data.setdefault("profile", path.stem)
    try:
        PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(path))) from None
    return config_from_dict(apply_overrides(data, overrides or []), f"{path} with --set {overrides}")


def config_from_dict(data: dict, source: str = "config") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None
