"""GLM-5's architecture (transformers' GlmMoeDsaForCausalLM) as the pipeline runs it: what differs from a dense
Llama, in one place.

DSA's indexer in transformers selects its top-k keys with `torch.topk`, whose order among equal scores depends on
the length of the row: the indexer's scores are sums of ReLUs, so exact ties (often exact zeros) are common, and a
30-token forward then attends to other keys than the first 30 positions of a 40-token one (0.03-0.05 in logits on
the toy preset), as do cached decoding and packing. For RL that is a mismatch between the rollout and the trainer
that no importance weight explains. `patch_indexer` selects with a stable sort instead: ties go to the earliest key,
whatever the length, padding or cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def is_glm5(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", "") in ("glm_moe_dsa", "deepseek_v32")


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
                     past_key_values=None):
    # transformers 5.23's GlmMoeDsaIndexer.forward (Apache-2.0) with the selection made stable
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads ** -0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    return index_scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk].to(torch.int32)


def patch_indexer() -> None:
    """Make every GLM-5 indexer select stably (idempotent; class-level, so checkpoints load unchanged)."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
    if m.GlmMoeDsaIndexer.forward is not _stable:
        m.GlmMoeDsaIndexer.forward = _stable


_stable = torch.no_grad()(_indexer_forward)
