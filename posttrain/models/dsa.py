"""DeepSeek Sparse Attention on a Hugging Face decoder (GLM-5 adopts it in mid-training; GLM-5.2 adds IndexShare).

`install(model, top_k, index_share, heads, own=...)` splits the layers into IndexShare groups (blocks of
`index_share` layers; each layer in `own` is a group of its own), gives each group's first layer a lightning
indexer and switches the model to attention "dsa": per query the indexer scores every allowed key (kernels.dsa),
the top `top_k` are kept, and attention runs over those only; the group's other layers reuse the selection. The
indexer's queries and per-head weights come from the layer's input hidden states (captured by a forward pre-hook:
the attention function receives only q, k, v); its keys are the layer's own rotated keys, averaged over key heads,
so decoding needs no second cache.

The indexer learns only from its own loss, the KL from the attention distribution (summed over heads) of each
layer of its group to the softmax of its scores, on a strided subset of queries with every input detached: over
all allowed keys in the dense warm-up (`mode = "warmup"`: attention stays dense, the rest of the model frozen by
the caller), over the selected keys once sparse. The losses and the top-k recall of the dense attention mass
collect on the model's `DSAState` (while its `collect` is set) for the training loop to add and report: the ramp's
sparse rungs and sft train them (sft moves the hidden states they select from); RL and OPD leave them as they are.
The settings live in config.json (`posttrain_dsa`) and the indexers in the weights, so `restore` reinstalls them
on load.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels.dsa import causal, indexer_scores, indexer_topk, selected_mask, sparse_attention, use_triton
from posttrain.models.added_weights import load_added_weights

CONFIG_KEY = "posttrain_dsa"


class Indexer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, std: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.w = nn.Linear(hidden, heads, bias=False)
        for lin in (self.q, self.w):
            nn.init.normal_(lin.weight, std=std)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [B, L, HI, D] (rotated like the layer's queries) and head weights [B, L, HI]."""
        if cos.shape[-1] != self.head_dim:
            raise ValueError(f"dsa: rotary embeddings cover {cos.shape[-1]} of the head's {self.head_dim} dimensions "
                             f"(partial rotary); the indexer supports full-head RoPE only")
        q = self.q(h).view(*h.shape[:-1], self.heads, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        half = self.head_dim // 2
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
        return q, self.w(h) / math.sqrt(self.heads)


class DSAState:
    """Shared by a model's layers: settings, the current selection per IndexShare group, and what the indexers
    measured since the caller last `pop`ped."""

    def __init__(self, top_k: int, kl_queries: int):
        self.top_k, self.kl_queries = top_k, kl_queries
        self.mode = "sparse"       # or "warmup": dense attention, the indexer learning the dense distribution
        self.collect = False       # compute the indexer loss and recall where gradients are on (the ramp sets it)
        self.kl_min_keys = 0       # ... on forwards of more keys than this only (DSAConfig.kl_min_keys)
        self.selection: dict[int, torch.Tensor | None] = {}
        self.index_inputs: dict[int, tuple | None] = {}  # the group indexer's (qi, w, ki) while it trains
        # GLM-5's own indexers (models.glm5) while they train: query rows -> those rows' scores, with their graph
        self.scores: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.recalls: list[torch.Tensor] = []

    def collects(self, keys: int) -> bool:
        """Whether a forward over `keys` keys computes the indexer loss."""
        return self.collect and torch.is_grad_enabled() and keys > self.kl_min_keys

    def pop(self) -> tuple[torch.Tensor | None, float | None, float | None]:
        """(sum of the indexer losses with their graph, their mean, mean top-k recall) since the last pop."""
        losses, recalls = self.losses, self.recalls
        self.losses, self.recalls = [], []
        self.scores.clear()
        if not losses:
            return None, None, None
        total = torch.stack(losses).sum()
        return total, total.item() / len(losses), torch.stack(recalls).mean().item()


def _stash(module, args, kwargs):
    if kwargs.get("position_embeddings") is None:
        raise ValueError(f"dsa: {type(module).__name__} is not given rotary position embeddings; the indexer "
                         f"rotates its queries like the layer's (RoPE decoders: Llama, Qwen, Mistral, ...)")
    module._dsa_in = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                      kwargs["position_embeddings"])


def allowed_keys(mask: torch.Tensor | None, b: int, lq: int, lk: int, device) -> torch.Tensor:
    """[B, Lq, Lk] bool from the mask transformers built for sdpa (None: plain causal)."""
    if mask is None:
        return causal(lq, lk, device).expand(b, -1, -1)
    mask = mask[:, 0, :, -lk:]
    return mask if mask.dtype == torch.bool else mask == 0


def indexer_loss(st: DSAState, query, key, scaling, scores_at, allowed, idx, rows=None, total=None) -> None:
    """KL(attention || indexer) and the top-k recall of the dense attention mass, on a strided subset of queries
    (or `rows`); `scores_at(rows)`: the indexer's scores [B, n, Lk] of those queries. `total(n)`: the count of the
    queries scored over every rank that holds some (the megatron engine's context parallelism), so that each rank
    adds its share of the mean."""
    lq = query.shape[2]
    if rows is None:
        rows = torch.linspace(0, lq - 1, min(lq, st.kl_queries), device=query.device).long()
    ok = allowed[:, rows]                                                   # [B, n, Lk]
    g = query.shape[1] // key.shape[1]
    with torch.no_grad():
        s = query[:, :, rows].float() @ key.float().repeat_interleave(g, 1).transpose(-1, -2) * scaling
        dense = torch.softmax(s.masked_fill(~ok[:, None], float("-inf")), -1).nan_to_num(0.0).mean(1)
        chosen = ok if idx is None else ok & selected_mask(idx[:, rows], key.shape[2])
        target = dense if st.mode == "warmup" else \
            torch.softmax(s.masked_fill(~chosen[:, None], float("-inf")), -1).nan_to_num(0.0).mean(1)
        on = (target > 0) & ok
        live = ok.any(-1)
        n = live.sum().float()
        n = (total(n) if total is not None else n).clamp(min=1)
        recall = (dense * chosen).sum(-1)[live].sum() / n
    scores = scores_at(rows)
    logq = torch.log_softmax(scores.masked_fill(~(ok if st.mode == "warmup" else chosen), float("-inf")), -1)
    kl = torch.where(on, target * (target.clamp(min=1e-30).log() - logq), 0.0).sum(-1)
    st.losses.append(kl[live].sum() / n)
    st.recalls.append(recall)


def _scores_of(qi, w, ki):
    return lambda rows: indexer_scores(qi[:, rows], w[:, rows], ki)


def dsa_attention(module, query, key, value, attention_mask, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs):
    """transformers' attention-function signature: (output [B, Lq, H, D], None)."""
    st: DSAState | None = getattr(module, "dsa_state", None)
    if st is None:
        raise ValueError("attention 'dsa' needs lightning indexers: "
                         "posttrain.models.dsa.install(model, top_k=..., ...)")
    hidden, (cos, sin) = module.__dict__.pop("_dsa_in")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    b, _, lq, _ = query.shape
    lk = key.shape[2]
    group = module.dsa_group
    allowed = allowed_keys(attention_mask, b, lq, lk, query.device)
    if hasattr(module, "indexer"):
        ki = key.detach().float().mean(1)
        qi, w = module.indexer(hidden.detach(), cos, sin)
        idx = indexer_topk(qi.detach(), w.detach(), ki, allowed, st.top_k) if lk > st.top_k else None
        st.selection[group] = idx
        training = st.collects(lk)
        st.index_inputs[group] = (qi, w, ki) if training else None
        if training:
            indexer_loss(st, query, key, scaling, _scores_of(qi, w, ki), allowed, idx)
    elif st.collects(lk) and st.index_inputs.get(group) is not None:
        # IndexShare: the layers that reuse the selection train the shared indexer too (KL to their own attention),
        # so it selects what the whole group attends to, not its first layer alone
        indexer_loss(st, query, key, scaling, _scores_of(*st.index_inputs[group]), allowed, st.selection[group])
    idx = st.selection[group]
    if st.mode == "warmup" or idx is None:  # every allowed key is selected: plain dense attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if use_triton(query) or lk > 4 * st.top_k:  # O(Lq * top_k)
        return sparse_attention(query, key, value, idx, scaling).transpose(1, 2).contiguous(), None
    # short contexts on CPU: the same result as dense math under the selection mask, cheaper than gathering
    sparse = allowed & selected_mask(idx, lk)
    sparse |= ~sparse.any(-1, keepdim=True)  # rows that select nothing (padding) attend anywhere, as sdpa's fix
    return sdpa_attention_forward(module, query, key, value, sparse[:, None], dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register("dsa", dsa_attention)
AttentionMaskInterface.register("dsa", sdpa_mask)


def _layers(model) -> nn.ModuleList:
    return getattr(model, "model", model).layers


def groups(n_layers: int, index_share: int, own: Sequence[int] = ()) -> list[int]:
    """The first layer of each layer's IndexShare group: blocks of `index_share` layers in order, except that each
    layer in `own` is a group alone. Adjacent layers mostly attend to the same keys, but not across a transition
    (the seeds: overlap 0.4 or less there); the first layer, reading token embeddings, is one: it cannot score a key
    by the tokens before it, which the layers after it retrieve by."""
    heads: list[int] = []
    for i in range(n_layers):
        start = heads[-1] if heads else None
        heads.append(i if start is None or i in own or start in own or i - start >= index_share else start)
    return heads


def install(model, top_k: int, index_share: int = 1, heads: int = 4, kl_queries: int = 64,
            own: Sequence[int] = ()):
    """Give `model` lightning indexers (new, randomly initialised) and switch it to attention "dsa"."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if top_k < 1 or index_share < 1 or heads < 1:
        raise ValueError(f"dsa: top_k, index_share and heads must be >= 1 (got {top_k}, {index_share}, {heads})")
    layers = _layers(model)
    if any(not 0 <= i < len(layers) for i in own):
        raise ValueError(f"dsa: own indexer layers {list(own)} must be layer indices of this {len(layers)}-layer model")
    state = DSAState(top_k, kl_queries)
    for i, (layer, head) in enumerate(zip(layers, groups(len(layers), index_share, own))):
        attn = layer.self_attn
        if head == i and not hasattr(attn, "indexer"):
            attn.indexer = Indexer(cfg.hidden_size, heads, head_dim, cfg.initializer_range).to(
                next(attn.parameters()).device)
        attn.dsa_state, attn.dsa_group = state, head
        if not getattr(attn, "_dsa_hooked", False):
            attn.register_forward_pre_hook(_stash, with_kwargs=True)
            attn._dsa_hooked = True
    setattr(cfg, CONFIG_KEY, {"top_k": top_k, "index_share": index_share, "heads": heads, "kl_queries": kl_queries,
                              "own": sorted(own)})
    model.set_attn_implementation("dsa")
    return model


def state(model) -> DSAState | None:
    return getattr(_layers(model)[0].self_attn, "dsa_state", None)


def restore(model, checkpoint: str | Path | None = None):
    """Reinstall the indexers a config names (config.json's `posttrain_dsa`), with their weights from
    `checkpoint`'s safetensors when given; a model without DSA is returned as is."""
    settings = getattr(model.config, CONFIG_KEY, None)
    if not settings:
        return model
    install(model, **settings)
    if checkpoint is not None:
        load_added_weights(model, checkpoint, lambda k: ".indexer." in k, "DSA indexers")
    return model


def indexer_parameters(model) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".indexer." in n]
