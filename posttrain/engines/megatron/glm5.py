"""GLM-5's architecture (transformers' GlmMoeDsaForCausalLM) in megatron-core's own modules: multi-head latent
attention (`MLASelfAttention`), routed experts with a shared one and sigmoid routing with an expert bias (`MoELayer`
with `moe_router_score_function="sigmoid"`, `moe_router_enable_expert_bias`), the first layers dense
(`moe_layer_freq`), expert parallelism over Megatron's expert groups.

The weight mapping is mbridge's DeepSeek-V3 bridge (GLM-5's attention and MoE are DeepSeek-V3's), which builds
Transformer Engine's layers only. What is patched here, because this engine builds Megatron's *local* spec:
the layer spec; the norm names of that spec (latent attention's query / key-value norms are modules of their own,
not fused into the next linear); the routed experts' names (`local_experts.{i}` of a SequentialMLP, numbered per
expert-parallel rank, instead of TE's grouped `weight{i}`); the model provider (mbridge's DeepSeek one hard-codes
TE's MTP spec and leaves the vocabulary unpadded); plain safetensors reading (its FP8 dequantising reader is bf16
only); and the latent norms' epsilon (transformers builds them at 1e-6 whatever `rms_norm_eps` says). Megatron's
routers get three methods of their own (`own_routers`: the expert load without a compile per batch shape, the
rollout's routes replayed, the sequence-wise balance loss), bound to the routers of the model being built, never to
megatron-core's classes: another model in the process routes as megatron-core does.

DeepSeek sparse attention's indexer is `dsa`'s (transformers' own indexer inside each layer's core
attention: megatron-core's `DSAttention` computes something else, that module says what). It needs Megatron's local
layers: with Transformer Engine's, the indexers' weights pass through from the checkpoint unchanged into every export,
which is exact only while the indexer selects every key of a row, and `check_rows` refuses longer rows. GLM-5's MTP
draft layer is `mtp`'s (transformers' layer beside the Megatron model).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from types import MethodType

import torch
import torch.distributed as dist
from safetensors import safe_open

from posttrain.engines.megatron import context_parallel, dsa
from posttrain.models.moe import load_stats, load_summary
from posttrain.routing_replay import check_routes

MODEL_TYPES = ("glm_moe_dsa",)
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc\d)\.weight$")
_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
INDEXER_WEIGHTS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
LATENT_NORM_EPS = 1e-6  # transformers' GlmMoeDsaRMSNorm default, which its q_a / kv_a layernorms keep


def check(hf_config, par, where: str = "megatron") -> None:
    """Refuse, before any work, what the mapping cannot split or would compute differently from transformers."""
    experts = hf_config.n_routed_experts
    if experts % par.ep:
        raise ValueError(f"{where}.ep: must divide the checkpoint's n_routed_experts ({experts}) (got {par.ep}; "
                         f"supported: {[d for d in range(1, experts + 1) if experts % d == 0]})")
    groups, topk_group = getattr(hf_config, "n_group", 1) or 1, getattr(hf_config, "topk_group", 1) or 1
    if groups > 1 and hf_config.num_experts_per_tok // topk_group != 2:
        # transformers scores a group by its top two experts, Megatron by its top k / topk_group
        raise ValueError(f"{where}: n_group {groups} with num_experts_per_tok {hf_config.num_experts_per_tok} and "
                         f"topk_group {topk_group}: Megatron's group score would differ from transformers' (it "
                         f"needs num_experts_per_tok / topk_group == 2); use runtime.train_engine torch")
    if par.tp > 1 and not par.sequence_parallel:
        raise ValueError(f"{where}.tp: Megatron splits a mixture-of-experts model over tensor-parallel ranks only with "
                         f"{where}.sequence_parallel (which needs Transformer Engine) (got tp {par.tp}); split the "
                         f"experts with {where}.ep instead")
    heads = hf_config.num_attention_heads
    if heads % par.tp:
        raise ValueError(f"{where}.tp: must divide the attention heads ({heads}) (got {par.tp}; supported: "
                         f"{[d for d in range(1, heads + 1) if heads % d == 0]})")


def check_rows(hf_config, length: int, checkpoint: str, sparse: bool) -> None:
    """A row whose attention would differ from GLM-5's sparse one: longer than the keys its DSA indexer keeps, where
    the engine's layers have no indexer (`sparse` false: Transformer Engine's)."""
    topk = getattr(hf_config, "index_topk", None)
    if topk is None or length <= topk or sparse:
        return
    raise ValueError(f"megatron: a {length}-token row is longer than {checkpoint}/config.json's index_topk ({topk}), "
                     f"on Transformer Engine's layers, which have no DSA indexer here: its attention would be dense "
                     f"where the checkpoint's is sparse; use Megatron's local layers or runtime.train_engine torch "
                     f"for this model")


def bridge_class(base, local_spec: bool, sdpa_attention):
    """mbridge's DeepSeek-V3 bridge, patched for GLM-5 on Megatron's local layers (the module docstring says what
    and why)."""
    from mbridge.core.bridge import Bridge  # megatron-core only after layout.cpu_patches (layout.py)
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    layer = "model.layers.{layer_number}."

    class Glm5(base):
        _ATTENTION_MAPPING = {**base._ATTENTION_MAPPING,
                              "self_attention.q_layernorm.weight": [layer + "self_attn.q_a_layernorm.weight"],
                              "self_attention.kv_layernorm.weight": [layer + "self_attn.kv_a_layernorm.weight"],
                              **{f"self_attention.core_attention.indexer.{w}": [f"{layer}self_attn.indexer.{w}"]
                                 for w in INDEXER_WEIGHTS}}
        _model_provider = LLMBridge._model_provider

        def _build_config(self):
            hf = self.hf_config
            dense = min(hf.first_k_dense_replace, hf.num_hidden_layers)
            groups = getattr(hf, "n_group", 1) or 1
            return self._build_base_config(
                layernorm_epsilon=hf.rms_norm_eps, ffn_hidden_size=hf.intermediate_size, qk_layernorm=True,
                moe_ffn_hidden_size=hf.moe_intermediate_size, num_moe_experts=hf.n_routed_experts,
                moe_router_topk=hf.num_experts_per_tok, moe_layer_freq=[0] * dense + [1] * (hf.num_hidden_layers - dense),
                moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
                moe_router_score_function="sigmoid", moe_router_pre_softmax=True, moe_router_dtype="fp32",
                moe_router_topk_scaling_factor=hf.routed_scaling_factor,
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf.topk_group if groups > 1 else None,
                # the bias is a buffer the engine moves itself (`balance_experts`), as the torch one
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_enable_routing_replay=True,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
                qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, rotary_base=hf.rope_theta,
                rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0)

        def _get_transformer_layer_spec(self, vp_stage=None):
            self.has_vp_stage = False
            if not local_spec:  # Transformer Engine's fused layers, mbridge's own mapping
                return get_gpt_decoder_block_spec(self.config, use_transformer_engine=True)
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization="RMSNorm")
            attention = dsa.core_attention(sdpa_attention(), self.hf_config)  # one class: shared selections
            for s in spec.layer_specs:
                s.submodules.self_attention.submodules.core_attention = attention
            return spec

        def _get_safetensor_io(self, weights_path):
            return Bridge._get_safetensor_io(self, weights_path)

        def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True):
            out = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            if consider_ep and self.mpu.ep_size > 1:  # this rank's experts are a slice of the layer's
                first = self.config.num_moe_experts // self.mpu.ep_size * self.mpu.ep_rank
                out = {k: (f"{m[1]}local_experts.{first + int(m[2])}.{m[3]}.weight"
                           if (m := _LOCAL_EXPERT.match(v)) else v) for k, v in out.items()}
            return out

        def _weight_name_mapping_mlp(self, name):
            if m := _LOCAL_EXPERT.match(name):
                name = f"{m[1]}{m[3]}.weight{m[2]}"
            return super()._weight_name_mapping_mlp(name)

        def export_weights(self, models):
            """Every expert on every rank: each expert-parallel rank's exports, gathered."""
            ep = self.mpu.ep_size
            per = self.config.num_moe_experts // ep
            for name, t in super().export_weights(models):
                if ep == 1 or not (m := _HF_EXPERT.match(name)):
                    yield name, t
                    continue
                parts = [torch.empty_like(t) for _ in range(ep)]
                dist.all_gather(parts, t.contiguous(), group=self.mpu.ep_group)
                for r, p in enumerate(parts):
                    yield f"{m[1]}{r * per + int(m[2])}.{m[3]}.weight", p

    return Glm5


def _count_load(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """Megatron's `TopKRouter._apply_expert_bias` (the expert load a step's balancing reads), with the padding mask
    as a column: megatron-core 0.16's broadcasts the [tokens] mask against the [tokens, experts] routing map, which
    fails, and is torch-compiled, a compile per batch shape."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                 default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's `RouterReplay.get_replay_topk` with the rollout's routes where it has them: a row of -1 (padding,
    the last generated token, a sample without routes) is left to the router, and the replayed tokens whose experts
    the router would have chosen otherwise are counted (posttrain.routing_replay's contract)."""
    # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
        return type(self).get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    forced = self.target_topk_idx.to(own.device, own.dtype)
    fresh = (forced < 0).any(-1, keepdim=True)
    with torch.no_grad():
        kept = ~fresh[:, 0]
        same = (forced.sort(-1).values == own.sort(-1).values).all(-1)
        n, differ = getattr(self, "replayed", (0, 0))
        self.replayed = (n + kept.sum(), differ + (kept & ~same).sum())  # tensors: no host sync per router call
    idx = torch.where(fresh, own, forced)
    return scores.gather(1, idx), idx


class SeqAux:
    """DeepSeek-V3's sequence-wise balance loss on Megatron's routers, as the torch engine computes it
    (`models.moe.RouterHooks.aux_loss`): per row, `sum_i f_i P_i` over the row's real tokens with `f_i` from the
    experts each token was routed to (the expert bias and a replayed route included), averaged over the model's
    routers and the batch's rows. megatron-core's own `seq_aux_loss` counts `f_i` from the top-k without the bias.
    Each router attaches its share to its output (`_routing`), with the weight the engine sets per micro-batch;
    with context parallelism each rank adds its tokens' share of every row's `P_i` (the counts summed over ranks)."""

    def __init__(self, routers: int):
        self.model_routers = routers  # the model's MoE layers, every pipeline stage's
        self.routers = routers  # router calls per forward: the model's, and a training draft layer's steps
        self.weight = 0.0       # moe.aux_loss_weight x the micro-batch's scale; 0: no loss (RL, evaluation)
        self.rows = 1           # rows with a real token in the whole batch (micro-batches share its mean)
        self.values: list[torch.Tensor] = []  # this rank's shares of the batches' losses, for the step's figure
        self.batches = 0

    def start(self, batch: dict[str, torch.Tensor], weight: float, draft_calls: int) -> None:
        """The next forwards are `batch`'s (its micro-batches'): the loss over its rows with a real token and every
        router call (the model's, and a training draft layer's steps), at `weight`."""
        mask = batch.get("attention_mask")
        self.rows = int((mask != 0).any(-1).sum()) if mask is not None else batch["input_ids"].shape[0]
        self.routers = self.model_routers + draft_calls
        self.weight = weight
        self.batches += 1

    def pop(self, stages: int) -> dict[str, float]:
        """The step's loss per batch (`moe_aux_loss`, the torch engine's curve), over every pipeline stage's routers
        and context-parallel rank's shares; {} without a batch."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        if not self.batches:
            return {}
        total = torch.tensor(float(sum(self.values)), dtype=torch.float64)
        for size, group in ((stages, ps.get_pipeline_model_parallel_group),
                            (context_parallel.size(), context_parallel.group)):
            if size > 1:
                dist.all_reduce(total, group=group())
        self.values, batches, self.batches = [], self.batches, 0
        return {"moe_aux_loss": total.item() / batches}

    def loss(self, logits: torch.Tensor, routing_map: torch.Tensor, padding: torch.Tensor | None, topk: int
             ) -> torch.Tensor:
        """This rank's share of the batch's loss from one router call: logits [s, b, E], routing_map [s * b, E]
        (sequence-major, as Megatron flattens), padding [s, b] (True: padding) or None."""
        s, b, n_exp = logits.shape
        scores = _DenseGrad.apply(logits).float().sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        real = torch.ones(s, b, dtype=torch.bool, device=logits.device) if padding is None else ~padding.reshape(s, b)
        counts = (routing_map.view(s, b, n_exp) & real[..., None]).sum(0).float()  # [b, E]
        tokens = real.sum(0).float()  # [b]
        if context_parallel.size() > 1:  # a row's counts over every rank's tokens; its P_i gradient stays local
            both = torch.cat([counts, tokens[:, None]], 1)
            dist.all_reduce(both, group=context_parallel.group())
            counts, tokens = both[:, :-1], both[:, -1]
        f = counts * n_exp / (topk * tokens.clamp_min(1))[:, None]
        share = (f * (probs * real[..., None]).sum(0)).sum(-1) / tokens.clamp_min(1)
        return share[tokens > 0].sum() / (self.routers * self.rows)


class _DenseGrad(torch.autograd.Function):
    """Identity whose gradient is contiguous: Megatron's router gating backward `view`s the one it gets."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """Megatron's `TopKRouter.routing`, with `SeqAux`'s loss attached to the probabilities while the engine sets a
    weight."""
    probs, routing_map = type(self).routing(self, logits, padding_mask)
    aux = getattr(self, "seq_aux", None)
    if aux is not None and aux.weight and torch.is_grad_enabled():
        loss = aux.loss(logits, routing_map, padding_mask, self.topk)
        if not dsa.recomputing():  # a recomputed forward's value was counted in the first
            aux.values.append(loss.detach())  # summed at the step's end: no host sync per router call
        probs = dsa.attach(probs, loss, aux.weight)
    return probs, routing_map


def own_routers(gpt) -> None:
    """This model's routers (this pipeline stage's) with `_count_load`, `_replay_topk` and `_routing` in place of
    megatron-core's methods: bound to each instance, so its classes, and any other model's routers, stay as they are."""
    for layer in gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        router._apply_expert_bias = MethodType(_count_load, router)
        router.routing = MethodType(_routing, router)
        if router.router_replay is not None:
            router.router_replay.get_replay_topk = MethodType(_replay_topk, router.router_replay)


def n_routers(hf_config) -> int:
    """The model's MoE layers (every pipeline stage's): its layers after the first dense ones."""
    return hf_config.num_hidden_layers - min(hf_config.first_k_dense_replace, hf_config.num_hidden_layers)


def moe_layers(gpt, hf_config) -> list[tuple[int, torch.nn.Module]]:
    """(the router's index among the model's routers, as transformers and the rollout count them; the router) for
    each MoE layer this pipeline stage holds."""
    dense = min(hf_config.first_k_dense_replace, hf_config.num_hidden_layers)
    return [(layer.layer_number - 1 - dense, layer.mlp.router) for layer in gpt.decoder.layers
            if getattr(layer.mlp, "router", None) is not None]


def balance_experts(gpt, hf_config, rate: float, sequence_parallel: bool, stages: int, draft=None
                    ) -> dict[str, float]:
    """The torch engine's aux-loss-free balancing (`models.moe.RouterHooks.after_step`) on this stage's Megatron
    routers, after an optimizer step: the step's expert load per MoE layer over every replica's tokens, its figures
    under the same names (every stage's), and each router's bias moved `rate` toward uniform load; the draft (MTP)
    layer's router after the model's, as the torch engine counts it."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    stats = {}
    for i, router in moe_layers(gpt, hf_config):
        load = router.local_tokens_per_expert.detach().float().clone()
        router.local_tokens_per_expert.zero_()
        if dist.get_world_size(group := ps.get_data_parallel_group(with_context_parallel=True)) > 1:
            dist.all_reduce(load, group=group)
        if sequence_parallel:  # each tensor-parallel rank routed its slice of the sequence
            dist.all_reduce(load, group=ps.get_tensor_model_parallel_group())
        if not float(load.sum()):
            continue
        stats[i] = load_stats(load)
        with torch.no_grad():
            router.expert_bias += rate * torch.sign(load.mean() - load)
    if draft is not None and (own := draft.balance(rate)) is not None:
        stats[n_routers(hf_config)] = own
    if stages > 1:  # each stage routed its own layers
        every = [None] * stages
        dist.all_gather_object(every, stats, group=ps.get_pipeline_model_parallel_group())
        stats = {k: v for part in every for k, v in part.items()}
    return load_summary(stats) if stats else {}


def replay_targets(samples: list, length: int, hf_config) -> torch.Tensor:
    """The samples' routes (posttrain.routing_replay) laid out as the engine's rows, prompt + completion from
    position 0, right-padded to `length`: [routers, samples, length, k], -1 where a position has no route."""
    k = check_routes(samples, n_routers(hf_config))
    out = torch.full((n_routers(hf_config), len(samples), length, k), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        if getattr(s, "routes", None) is not None:
            n = min(length, s.routes.shape[1])
            out[:, b, :n] = s.routes[:, :n]
    return out


@contextmanager
def replaying(gpt, hf_config, targets: torch.Tensor | None):
    """The routers of this stage forced to `targets` [routers, b, s, k] (this rank's rows and positions) for one
    forward; nothing when None. Megatron's router sees the tokens sequence-major ([s, b] flattened)."""
    if targets is None:
        yield
        return
    # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    layers = moe_layers(gpt, hf_config)
    for i, router in layers:
        router.router_replay.set_target_indices(targets[i].transpose(0, 1).reshape(-1, targets.shape[-1]))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, router in layers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()


def take_replayed(gpt, hf_config) -> tuple[int, int]:
    """(routes replayed, of which the router would have chosen otherwise) on this stage since the last call."""
    n = differ = 0
    for _, router in moe_layers(gpt, hf_config):
        a, b = getattr(router.router_replay, "replayed", (0, 0))
        router.router_replay.replayed = (0, 0)
        n, differ = n + int(a), differ + int(b)
    return n, differ


def finish(gpt) -> None:
    """What the built model still needs: its routers' own methods (`own_routers`); the latent norms' epsilon; on the
    local layers, latent attention handing its core attention the hidden states and compressed queries the DSA
    indexer reads (Megatron does that for its own `DSAttention` only, and refuses context parallelism at config time
    with it set), and the indexers frozen (only the ramp's DSA adoption trains them, from a loss of their own)."""
    own_routers(gpt)
    for layer in gpt.decoder.layers:
        attention = layer.self_attention
        for norm in (attention.q_layernorm, attention.kv_layernorm):
            if hasattr(norm, "eps"):
                norm.eps = LATENT_NORM_EPS
        if getattr(attention.core_attention, "indexer", None) is not None:
            attention.config.experimental_attention_variant = "dsa"
            attention.core_attention.indexer.requires_grad_(False)


def sparse_layers(gpt) -> bool:
    """Whether this model's layers run the DSA indexer (Megatron's local layers; not Transformer Engine's)."""
    return any(hasattr(layer.self_attention.core_attention, "indexer") for layer in gpt.decoder.layers)


def passthrough(checkpoint: str, hf_config, indexers: bool) -> dict[str, torch.Tensor]:
    """The DSA indexers' tensors of the checkpoint where the engine's layers have none (`indexers`: Transformer
    Engine's), for every export under transformers' names."""
    if not indexers:
        return {}
    n, out = hf_config.num_hidden_layers, {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()
                    if ".self_attn.indexer." in k and not k.startswith(f"model.layers.{n}.")}
    return out


def to_transformers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors (the checkpoint's on-disk names) as transformers 5 holds them in memory: one
    `gate_up_proj` [E, 2I, H] and one `down_proj` [E, H, I] per layer."""
    out, experts = {}, {}
    for name, t in weights.items():
        if m := _HF_EXPERT.match(name):
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            out[name] = t
    for prefix, parts in experts.items():
        n = 1 + max(i for i, _ in parts)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([parts[i, "gate_proj"], parts[i, "up_proj"]])
                                                    for i in range(n)])
        out[prefix + "down_proj"] = torch.stack([parts[i, "down_proj"] for i in range(n)])
    return out
