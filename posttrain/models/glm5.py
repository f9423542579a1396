"""GLM-5's architecture (transformers' GlmMoeDsaForCausalLM) as the pipeline runs it: what differs from a dense
Llama, in one place.

DSA's indexer in transformers selects its top-k keys with `torch.topk`, whose order among equal scores depends on
the length of the row: the indexer's scores are sums of ReLUs, so exact ties (often exact zeros) are common, and a
30-token forward then attends to other keys than the first 30 positions of a 40-token one (0.03-0.05 in logits on
the toy preset), as do cached decoding and packing. For RL that is a mismatch between the rollout and the trainer
that no importance weight explains. `StableIndexer` selects with a stable sort instead: ties go to the earliest key,
whatever the length, padding or cache; `stable_indexers` makes a model's indexers that (its own modules, not the
library's class: posttrain.models.preset does it wherever a model is built or loaded).

DSA's adoption in the ramp (`install_dsa`) drives these same indexers: GLM-5's recipe, a dense warm-up where only
the indexers learn the dense attention distribution (KL), then sparse training at top-k with that KL on the selected
keys, is `posttrain.models.dsa`'s, with the model's own indexers in place of the ones that module adds to a dense
decoder. The checkpoint it leaves is a plain GlmMoeDsaForCausalLM whose `index_topk` is the ramp's top-k."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, apply_rotary_pos_emb_interleave

from kernels.dsa import selected_mask
from posttrain.models.dsa import DSAState, allowed_keys, indexer_loss

DENSE_TOPK = 1 << 30  # an index_topk no row reaches: every key selected, DSA not adopted yet


def is_glm5(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", "") in ("glm_moe_dsa", "deepseek_v32")


def dsa_adopted(model) -> bool:
    """A GLM-5 model whose indexers already select (a ramp adopted DSA, or a real GLM-5 checkpoint)."""
    return is_glm5(model) and getattr(model.config, "index_topk", DENSE_TOPK) < DENSE_TOPK


def config_errors(config) -> list[str]:
    """What in a GLM-5-shaped config.json would fail layers in (or silently misbuild): per-layer lists that do not
    match the layer count, a shared indexer with no full one before it, experts that do not split into groups."""
    if getattr(config, "model_type", "") not in ("glm_moe_dsa", "deepseek_v32"):
        return []
    n, errors = config.num_hidden_layers, []
    for key in ("indexer_types", "mlp_layer_types"):
        types = getattr(config, key, None)
        if types is not None and len(types) != n:
            errors.append(f"{key} has {len(types)} entries for num_hidden_layers {n}")
    types = getattr(config, "indexer_types", None) or []
    if types and types[0] != "full":
        errors.append(f"indexer_types[0] is {types[0]!r}: a shared layer reuses the selection of a full one before it")
    e, groups = getattr(config, "n_routed_experts", 0), getattr(config, "n_group", 1) or 1
    if e and e % groups:
        errors.append(f"n_routed_experts {e} does not split into n_group {groups} groups")
    return errors


def _indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                     past_key_values=None, train: bool = False, gather_keys=None):
    # transformers 5.23's GlmMoeDsaIndexer.forward (Apache-2.0) with the selection made stable; `train`: a function of
    # query rows giving their scores with a graph (from detached inputs: the indexer learns only from its own loss)
    # goes on the DSA state, for `install_dsa`'s KL;
    # `gather_keys`: the whole sequence's keys from this rank's [b, s, d] (the megatron engine's context parallelism)
    if train:
        hidden_states, q_resid = hidden_states.detach(), q_resid.detach()
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if gather_keys is not None:
        k = gather_keys(k)
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads ** -0.5)

    def scores_of(q, weights, mask):  # [b, n, h, d], [b, n, h], [b or 1, n, t] -> [b, n, t]
        n = q.shape[1]
        # one [n*h, d] x [d, t] product per row: the library's broadcast matmul ([b, s, h, d] x [b, 1, d, t]) copies
        # the keys once per query position (a quarter of a 16 x 512 training step of the tiny profile on CPU)
        scores = torch.bmm(q.float().reshape(b, n * self.n_heads, self.head_dim), k.float().transpose(-1, -2))
        scores = F.relu(scores.view(b, n, self.n_heads, -1) * self.softmax_scale)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        if mask.dtype == torch.bool:
            return index_scores.masked_fill(~mask, float("-inf"))
        return index_scores + mask

    with torch.no_grad():  # the selection needs no graph
        index_scores = scores_of(q, weights, attention_mask)
    st = getattr(self, "dsa_state", None)
    if train:
        # the KL needs the scores of a few query rows (`kl_queries`) with their graph: recompute just those rather
        # than keep every query's [h, t] scores for backward (that way the KL cost a third of a 16 x 512 sparse step)
        st.scores[self.layer_idx] = lambda rows: scores_of(q[:, rows], weights[:, rows], attention_mask[:, rows])
    # the dense warm-up selects every key: attention stays dense while the indexer learns it
    every = st is not None and st.mode == "warmup"
    topk = index_scores.shape[-1] if every else min(self.index_topk, index_scores.shape[-1])
    return index_scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk].to(torch.int32)


class StableIndexer(GlmMoeDsaIndexer):
    """transformers' GLM-5 indexer selecting stably (`_indexer_forward`), and training from its own loss while its
    `dsa_state` collects (`install_dsa`). The same parameters and state-dict keys as the library's."""

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs):
        st = getattr(self, "dsa_state", None)  # set by install_dsa only
        train = st is not None and st.collects(attention_mask.shape[-1])
        if st is not None and not train:  # the layers sharing this indexer find no scores of an earlier forward
            st.scores.pop(self.layer_idx, None)
        if not train and _selects_every_key(self, st, attention_mask, kwargs):
            # every key is kept whatever the scores: skip them (half a 16 x 512 training step of the tiny (GLM-5)
            # profile went to scoring and sorting keys that were all selected)
            b, s, n = hidden_states.shape[0], hidden_states.shape[1], attention_mask.shape[-1]
            return torch.arange(n, device=hidden_states.device).expand(b, s, n)
        with torch.set_grad_enabled(train):
            return _indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, *args,
                                    train=train, **kwargs)


def _selects_every_key(indexer, st, attention_mask, kwargs) -> bool:
    """Whether this forward's selection is every key: DSA not adopted (or its dense warm-up), and the keys are the
    mask's (a decode cache needs the indexer's keys stored; gathered keys are more than the mask's)."""
    if kwargs.get("past_key_values") is not None or kwargs.get("gather_keys") is not None:
        return False
    return (st is not None and st.mode == "warmup") or indexer.index_topk >= attention_mask.shape[-1]


def stable_indexers(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every GLM-5 indexer under it (itself included) a `StableIndexer`: the modules of this model
    only, never the library's class (a model built elsewhere keeps its own selection). Idempotent; what builds or
    loads a model for posttrain calls it (posttrain.models.preset, the MTP layer, `install_dsa`)."""
    for m in module.modules():
        if type(m) is GlmMoeDsaIndexer:
            m.__class__ = StableIndexer
    return module


def mla_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, with MLA's values padded to the queries' head dim on CPU (the tiny profile's
    GLM-5: 48 query and key dims, 32 value dims): torch's CPU flash kernel wants equal head dims, and without them
    sdpa with a mask falls back to the math path, which materializes every score. On 2 CPU cores
    (bench.glm5_attention): a 16 x 512 sparse training step's forward and backward 1.27x faster, greedy generation
    from ~480-token prompts 1.22x; no gain in training at 256 keys or fewer (4-6% slower at 128), none in one-token
    decoding, hence the rule below. Registered as "sdpa" (transformers' own override point): with equal head dims,
    or off the CPU, it is the library's function unchanged."""
    dv, dq = value.shape[-1], query.shape[-1]
    if dv >= dq or query.device.type != "cpu" or (torch.is_grad_enabled() and key.shape[-2] <= 256):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query, key, F.pad(value, (0, dq - dv)), attention_mask, **kwargs)
    return out[..., :dv], weights


AttentionInterface.register("sdpa", mla_sdpa)


def dsa_attention(module, query, key, value, attention_mask, scaling: float | None = None, dropout: float = 0.0,
                  indices=None, **kwargs):
    """GLM-5's sparse attention (transformers' sdpa path: the causal mask narrowed to the indexer's top-k keys), plus
    the indexer loss while the ramp trains it: transformers hands an attention implementation other than eager and
    sdpa the causal mask and the selected `indices` apart, both of which the KL needs."""
    st = module.dsa_state
    b, _, lq, _ = query.shape
    lk = key.shape[2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    allowed = allowed_keys(attention_mask, b, lq, lk, query.device)
    scores = st.scores.get(module.dsa_group)
    if st.collects(lk) and scores is not None:  # shared layers train their group's indexer too
        indexer_loss(st, query, key, scaling, scores, allowed, indices)
    chosen = allowed & selected_mask(indices, lk)
    chosen |= ~chosen.any(-1, keepdim=True)  # rows that select nothing (padding) attend anywhere, as sdpa's fix
    return mla_sdpa(module, query, key, value, chosen[:, None], dropout=dropout, scaling=scaling, **kwargs)


def install_dsa(model, top_k: int, kl_queries: int = 64):
    """DSA's adoption on a GLM-5 model's own indexers (`indexer_types` decides which layers have one; a shared layer
    reuses the full layer's before it): each keeps `top_k` keys from now on, and the model attends through
    `dsa_attention`, which collects the indexers' KL on the model's `DSAState` (`posttrain.models.dsa.state`) while
    its `collect` is set."""
    if top_k < 1:
        raise ValueError(f"dsa: top_k must be >= 1 (got {top_k})")
    stable_indexers(model)
    AttentionInterface.register("glm5_dsa", dsa_attention)
    AttentionMaskInterface.register("glm5_dsa", sdpa_mask)
    state, group = DSAState(top_k, kl_queries), 0
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.indexer is not None:
            group = i
            attn.indexer.index_topk, attn.indexer.dsa_state = top_k, state
        attn.dsa_state, attn.dsa_group = state, group
    model.config.index_topk = top_k  # saved: the checkpoint attends sparsely wherever it is loaded
    model.set_attn_implementation("glm5_dsa")
    return model
