"""Config sections for the training stages: base, the context ramp, sft, RL, OPD, LoRA, the cross-stage chains."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from posttrain.config.common import AtLeast0, AtLeast1, NonNegative, Positive, Share, _error_line, _Strict


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
    # the generalist written as (1 - w) * its weights + w * the base's (posttrain/merge.py: model averaging against
    # what post-training cost, Lin et al. 2023); 0: the generalist as OPD left it
    base_weight: Share = 0.0
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

    def uses_base(self) -> bool:
        """The base checkpoint is an input: as a teacher, or averaged into the generalist."""
        return self.base_teaches() or self.base_weight > 0


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
