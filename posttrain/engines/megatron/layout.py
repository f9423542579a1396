"""How the megatron engine lays a model out over ranks: the split (`Parallel`), megatron-core's process groups, and
the HF <-> Megatron weight bridges that build this rank's part of the model (for `engine`).

Weights go through mbridge (0.15.1): it maps Hugging Face Llama / Qwen2 / Qwen3 tensors to Megatron's fused
layouts (QKV interleaved per query group, gate and up stacked) and splits or gathers them over tensor-parallel
ranks. We patch two things, both because we build Megatron's *local* layer spec (plain torch modules) instead of
Transformer Engine's, which has no CPU build: the spec (mbridge hard-codes TE's), and the two norm names that
spec uses (`input_layernorm`, `pre_mlp_layernorm`; TE folds them into the next linear). Megatron-Bridge, the
other converter, imports Transformer Engine at load, so it cannot run without a GPU. GLM-5's mapping (mbridge's
DeepSeek-V3 bridge, patched likewise) is in `glm5`.

On a machine without CUDA, megatron-core 0.16 allocates RoPE frequencies and attention buffers on
`torch.cuda.current_device()`; `cpu_patches` answers "cpu" there (only when torch has no CUDA at all).

megatron-core and mbridge are imported inside the functions, here and in the package's other modules: only once
`cpu_patches` has run, which quiets their import-time warnings and answers their CUDA calls on a machine without it.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import tempfile
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from posttrain.engines.megatron import context_parallel, glm5

SUPPORTED = ("llama", "qwen2", "qwen3", "glm_moe_dsa")  # HF model_type -> mbridge's bridge (GLM-5: `glm5`)


@dataclass(frozen=True)
class Parallel:
    """How one model is split over ranks (world = tp x pp x cp x dp); `ep` splits a MoE model's experts over ep of
    the data-parallel ranks."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def model_ranks(self) -> int:
        """The fewest ranks that hold the model: tp x pp x cp x ep. Where a stage trains one replica (RL, OPD, a
        ramp rung) its ep ranks each see the whole batch: the experts split, the dense layers repeat, and the
        gradients are the one replica's (`optimizer.sync_grads`)."""
        return self.tp * self.pp * self.cp * self.ep


def cpu_patches() -> None:
    """The CUDA device answer (and a no-op synchronize) on a machine without CUDA, and megatron-core imported without
    its warnings that Apex and Transformer Engine are absent (one per module, repeated by every Ray worker): the local
    spec needs neither."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's writer syncs before it reads tensors
        # the MoE all-to-all dispatcher copies its token counts to the host on a side stream: on CPU they are there
        torch.cuda.Stream = _HostStream
        torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    with quiet():
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        if not torch.cuda.is_available():  # its CP slice of the RoPE table moves an index to CUDA
            # megatron-core only after layout.cpu_patches (layout.py)
            from megatron.core.models.common.embeddings import rotary_pos_embedding
            rotary_pos_embedding.get_pos_emb_on_this_cp_rank = context_parallel.rope_slice
            # with pipeline stages and tied embeddings the last stage's copy of the embeddings is moved to CUDA
            # before the all-reduce that initialises it
            from megatron.core.models.common.language_module.language_module import LanguageModule
            LanguageModule.setup_embeddings_and_output_layer = _on_cpu(
                LanguageModule.setup_embeddings_and_output_layer)
        if not _has_te():  # its TE wrappers import without TE (as placeholders), so latent attention believes it has it
            # megatron-core only after layout.cpu_patches (layout.py)
            from megatron.core.transformer import multi_latent_attention
            multi_latent_attention.HAVE_TE = False
            from megatron.core.transformer.moe import moe_utils  # the router's GEMM: TE's when its name exists
            moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
        if not torch.cuda.is_available():  # the all-to-all's split sizes: numpy once "copied to the host"
            # megatron-core only after layout.cpu_patches (layout.py)
            from megatron.core.transformer.moe import token_dispatcher
            token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
        import megatron.core.optimizer  # noqa: F401
        import mbridge  # noqa: F401


class _HostStream:
    """A CUDA stream's waits and events on a machine without CUDA, where there is nothing to wait for."""

    def wait_stream(self, other) -> None:
        pass  # deliberate: host work is already ordered, so there is no other stream to wait for

    def record_event(self):
        return self

    def synchronize(self) -> None:
        pass  # deliberate: the "device-to-host" copies it would wait for are plain host tensors here


_HOST_STREAM = _HostStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` for a tensor already on the host: numpy when asked (its version
    converts CUDA tensors only, and the all-to-all then gets tensors for its split sizes)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _on_cpu(fn):
    """`fn` with `Tensor.cuda` answering the tensor itself, for a machine without CUDA (once: patched again, as
    every engine calls `cpu_patches`, it stays one wrapper)."""
    if getattr(fn, "_on_cpu", False):
        return fn

    def run(*args, **kwargs):
        cuda, torch.Tensor.cuda = torch.Tensor.cuda, lambda t, *a, **k: t
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda
    run._on_cpu = True
    return run


@contextlib.contextmanager
def quiet():
    """Without megatron-core's warnings about what the local spec does not use (Apex, Transformer Engine, CUDA
    graphs) and its deprecation notices for arguments mbridge does not pass yet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|full scope|tp_group is None).*")
        warnings.filterwarnings("ignore", message="MLP requires ffn_hidden_size")
        yield


def check_layout(hf_config, par: Parallel, where: str = "megatron") -> None:
    """Refuse, before any work, an architecture no bridge maps and a split that does not divide the model."""
    kind = getattr(hf_config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ValueError(f"runtime.train_engine megatron: no Megatron mapping for model_type {kind!r} "
                         f"(supported: {', '.join(SUPPORTED)}); use runtime.train_engine torch for it")
    moe = kind in glm5.MODEL_TYPES
    if moe:
        glm5.check(hf_config, par, where)
    heads, kv = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or \
        hf_config.num_attention_heads
    if not moe and (heads % par.tp or kv % par.tp):
        raise ValueError(f"{where}.tp: must divide the attention heads ({heads}) and key-value heads ({kv}) "
                         f"(got {par.tp}; supported: {sorted(d for d in range(1, kv + 1) if kv % d == 0)})")
    if par.pp > hf_config.num_hidden_layers or hf_config.num_hidden_layers % par.pp:
        raise ValueError(f"{where}.pp: must divide the layers ({hf_config.num_hidden_layers}) (got {par.pp})")
    if par.ep != 1 and not moe:
        raise ValueError(f"{where}.ep: must be 1 for the dense model_type {kind!r} (got {par.ep})")
    if par.sequence_parallel and par.tp == 1:
        raise ValueError(f"{where}.sequence_parallel: needs tp > 1 (got tp {par.tp})")
    # Megatron's local spec (plain torch modules) cannot split the sequence in its norms; Transformer Engine's spec
    # can, and installs with CUDA only
    if par.sequence_parallel and not _has_te():
        raise ValueError(f"{where}.sequence_parallel: needs Transformer Engine (not installed here)")
    if par.cp > 1 and par.sequence_parallel:
        raise ValueError(f"{where}.cp: with sequence_parallel needs Transformer Engine's attention, which this engine "
                         f"does not drive yet; set one of them off")


def _has_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def local_spec(par: Parallel) -> bool:
    """Whether the engine builds Megatron's local layers with `sdpa_attention`: where Transformer Engine is missing,
    and with context parallelism anywhere (TE's ring attention is not driven here; ours runs on CUDA as on CPU)."""
    return not _has_te() or par.cp > 1


def init_parallel(par: Parallel, seed: int = 0) -> None:
    """torch.distributed (gloo on CPU, NCCL on CUDA) and Megatron's groups. A process not started under a
    launcher (one rank: tests, the local pipeline) gets a world of one through a file store, so it needs no port.
    Every engine of one process shares the groups, so they must agree on the split."""
    cpu_patches()
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            store = tempfile.NamedTemporaryFile(prefix="posttrain-megatron-", delete=False).name
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world % par.model_ranks:
        raise ValueError(f"megatron.tp: tp x pp x cp x ep = {par.model_ranks} must divide the world of {world} ranks "
                         f"this stage runs (sft: sft.workers Ray Train workers)")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (par.tp, par.pp, par.cp, par.ep):
            raise ValueError(f"megatron: this process already runs tp/pp/cp/ep {have}, not "
                             f"{(par.tp, par.pp, par.cp, par.ep)}")
        return
    ps.initialize_model_parallel(par.tp, par.pp, context_parallel_size=par.cp, expert_model_parallel_size=par.ep)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    else:  # the CUDA RNG tracker has no CPU form; with dropout off nothing draws from it
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def bridge(hf_config, par: Parallel, dtype: torch.dtype = torch.float32, recompute: bool = False):
    """An mbridge bridge for `hf_config` building Megatron's local layer spec, every fusion off (they need TE or
    Apex), the vocabulary padded to a multiple of tp (the padded rows never score: `vocab_parallel`).
    `recompute` on CUDA: Megatron's full-layer recomputation (its RNG tracker has no CPU form; `recompute_layers`
    does the same on CPU)."""
    from mbridge.core.bridge import _MODEL_REGISTRY  # megatron-core only after layout.cpu_patches (layout.py)
    from mbridge.core.parallel_states import ParallelStates
    if getattr(hf_config, "rope_theta", None) is None:  # transformers 5 keeps it in rope_parameters
        hf_config.rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    if (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default") != "default":
        raise ValueError(f"megatron: rope_type {hf_config.rope_parameters['rope_type']!r} has no Megatron mapping "
                         f"here (default RoPE only); use runtime.train_engine torch")
    if hf_config.model_type in glm5.MODEL_TYPES:  # GLM-5 is DeepSeek-V3's attention and MoE
        cls = glm5.bridge_class(_MODEL_REGISTRY["deepseek_v3"], local_spec(par), sdpa_attention)
    else:
        cls = _dense_bridge_class(_MODEL_REGISTRY[hf_config.model_type], par,
                                  bool(getattr(hf_config, "tie_word_embeddings", False)))
    b = cls(hf_config, dtype=dtype, parallel_states=ParallelStates.get_parallel_state(),
            make_vocab_size_divisible_by=par.tp)
    b.set_extra_args(use_cpu_initialization=not torch.cuda.is_available(), masked_softmax_fusion=False,
                     bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                     apply_rope_fusion=False, persist_layer_norm=False, attention_softmax_in_fp32=True,
                     sequence_parallel=par.sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
                     **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                        if recompute and torch.cuda.is_available() else {}))
    return b


def _dense_bridge_class(base, par: Parallel, tied: bool):
    """mbridge's bridge of a dense family on Megatron's local layers (the module docstring says what is patched)."""
    # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    layer = "model.layers.{layer_number}."

    class Local(base):
        # with pipeline stages the last one holds its own copy of tied embeddings as its output layer
        _DIRECT_MAPPING = {**base._DIRECT_MAPPING, **({"output_layer.weight": "model.embed_tokens.weight"}
                                                      if tied else {})}
        _OTHER_MAPPING = {**base._OTHER_MAPPING, "input_layernorm.weight": [layer + "input_layernorm.weight"]}
        _MLP_MAPPING = {**base._MLP_MAPPING, "pre_mlp_layernorm.weight": [layer + "post_attention_layernorm.weight"]}

        def _get_transformer_layer_spec(self, vp_stage=None):
            if not local_spec(par):  # Transformer Engine's fused layers, mbridge's own mapping
                return super()._get_transformer_layer_spec(vp_stage)
            self.has_vp_stage = False
            spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=self.config.qk_layernorm)
            spec.submodules.self_attention.submodules.core_attention = sdpa_attention()
            return spec
    return Local


def recompute_layers(gpt) -> None:
    """Full-layer activation recomputation without CUDA: each decoder layer's forward under torch's checkpoint
    (dropout is off, so no RNG state needs replaying)."""
    for layer in gpt.decoder.layers:
        run = layer.forward
        layer.forward = lambda *a, _run=run, **kw: checkpoint(_run, *a, use_reentrant=False, **kw)


def sdpa_attention():
    """Megatron's local core attention with torch's scaled_dot_product_attention in place of its explicit
    [b, heads, s, s] scores and softmax (which also builds its causal mask on CUDA): one fused kernel where torch
    has one, grouped-query heads without repeating the keys. No mask given: causal. With context parallelism
    (`context_parallel`) the keys and values of the whole sequence are gathered and the mask (always given
    then) is this rank's queries' rows. An integer `attention_mask` holds document ids [b, T] instead of a mask:
    attention then runs per document (`context_parallel.document_attention`), with no [T, T] mask."""
    # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            # latent attention (MLA) names its query/key and value head sizes; Megatron's local attention takes
            # neither, and SDPA reads them from the tensors
            one = copy.copy(config)  # Megatron's local attention refuses context parallelism: this one runs it
            one.context_parallel_size = 1
            super().__init__(one, *args, **kwargs)
            self.config = config

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("megatron: packed sequences and attention biases need Transformer Engine")
            s, b = query.shape[:2]
            if context_parallel.size() > 1:
                key, value = context_parallel.GatherKV.apply(key), context_parallel.GatherKV.apply(value)
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
            gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
            if attention_mask is not None and attention_mask.dtype == torch.long:  # document ids [b, T]: long rows
                out = context_parallel.document_attention(q, k, v, attention_mask, self.softmax_scale, gqa)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
                    is_causal=attention_mask is None, scale=self.softmax_scale, enable_gqa=gqa)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
    return SdpaAttention
