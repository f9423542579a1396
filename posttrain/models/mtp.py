"""Multi-token prediction (MTP) on a Hugging Face causal LM, as GLM-5 uses it: one extra transformer layer whose
parameters are shared across `depth` draft steps, with the model's own embedding and output head.

Draft step k at position i reads the previous step's state there (the model's last hidden state for k = 1) and
the embedding of token i + k, runs the MTP layer (causal attention over the same positions) and predicts token
i + k + 1 through the shared head (DeepSeek-V3's MTP with GLM-5's parameter sharing). Training adds the mean
cross-entropy of the `depth` steps, times a weight, to the LM loss (`with_loss`), at the positions whose target
the LM loss trains; the MTP layer starts as a copy of the model's last layer. Its weights sit under `mtp.` in the
checkpoint and its settings in config.json (`posttrain_mtp`), so `restore` reinstalls it on load.

On a GLM-5-shaped model the layer is GLM-5's own draft layer and is stored as GLM-5 and DeepSeek-V3 checkpoints
store it: layer `num_hidden_layers` (`enorm`, `hnorm`, `eh_proj` over [embedding, state], the decoder layer with
its routed experts and an indexer of its own, `shared_head.norm`; the embedding and head are the model's), with
`num_nextn_predict_layers: 1` in config.json, so a serving engine's speculative decoding can load it, and a GLM-5
checkpoint that carries one is trained and exported with it.

Decoding with it (`posttrain.engines.speculative`) drafts `depth` tokens, checks them in one forward of the
model and keeps what the model would have produced: greedy output is plain greedy output, and sampled output
follows the model's distribution exactly (speculative sampling).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from posttrain.models.added_weights import load_added_weights
from posttrain.models.glm5 import is_glm5, stable_indexers
from posttrain.models.logits import scaling

CONFIG_KEY = "posttrain_mtp"
# our MTP module's names -> GLM-5's under layer num_hidden_layers (the decoder layer's own names are kept)
GLM5_NAMES = (("norm_e.", "enorm."), ("norm_h.", "hnorm."), ("proj.", "eh_proj."), ("norm_out.", "shared_head.norm."),
              ("layer.", ""))


def _layers(model) -> nn.ModuleList:
    return model.base_model.layers


class _FusedRMSNorm(nn.Module):
    """An RMSNorm as one `F.rms_norm` call: one kernel on a GPU where transformers' Llama-style norm launches six;
    the MTP layer's draft steps are bound by kernel launches when decoding (bench/mtp on an H100)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _fuse_norms(module: nn.Module) -> None:
    """Swap each RMSNorm under `module` for `_FusedRMSNorm` where it computes the same (checked on a probe; a norm of
    another form, Gemma's 1 + weight say, stays as it is). Same parameters, same state-dict keys."""
    for name, child in module.named_children():
        w = getattr(child, "weight", None)
        if isinstance(getattr(child, "variance_epsilon", None), float) and isinstance(w, torch.Tensor) and w.dim() == 1:
            with torch.no_grad():
                probe = torch.randn(4, w.shape[0], device=w.device, dtype=w.dtype)
                fused = _FusedRMSNorm(child)
                # within rounding: in bf16 the two round at different points (one ulp apart, 0.8%)
                if torch.allclose(child(probe), fused(probe), rtol=max(1e-3, 2 * torch.finfo(w.dtype).eps), atol=1e-5):
                    setattr(module, name, fused)
        else:
            _fuse_norms(child)


class MTP(nn.Module):
    """The shared MTP layer: norms of the incoming state and of the next token's embedding, a projection of
    both to the hidden size, one decoder layer of the model's own class, a final norm before the shared head."""

    def __init__(self, model, depth: int):
        super().__init__()
        base, last = model.base_model, _layers(model)[-1]
        self.config = config = copy.deepcopy(model.config)
        self.follow_attention(model)
        self.depth, hidden = depth, model.config.hidden_size
        self.norm_h, self.norm_e, self.norm_out = (copy.deepcopy(base.norm) for _ in range(3))
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # starts as "the state, plus a little of the next token"
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden].copy_(torch.eye(hidden))
            nn.init.normal_(self.proj.weight[:, hidden:], std=model.config.initializer_range)
        if is_glm5(model):
            # GLM-5's draft layer: the last layer's MLP kind and an indexer of its own. It is built as layer 0 of a
            # config whose layer 0 is that, so caches and per-layer lists index it as a one-layer model's (it is
            # saved as layer num_hidden_layers); a last layer sharing its indexer leaves the new one at its init
            for key, kind in (("mlp_layer_types", config.mlp_layer_types[-1]), ("indexer_types", "full")):
                setattr(config, key, [kind] + list(getattr(config, key))[1:])
        self.layer = stable_indexers(type(last)(config, layer_idx=0))  # GLM-5's indexer selects stably (models.glm5)
        # posttrain's own DSA indexers belong to the model's layers. A last layer on the meta device has nothing to
        # copy: the megatron engine's host (`engines.megatron_mtp`), which loads the layer from a checkpoint
        if not any(p.is_meta for p in last.parameters()):
            own = is_glm5(model)
            self.layer.load_state_dict({k: v for k, v in last.state_dict().items() if own or ".indexer." not in k},
                                       strict=False)
        _fuse_norms(self)
        self.to(next(model.parameters()).device, next(model.parameters()).dtype)

    def follow_attention(self, model) -> None:
        """The draft layer needs a plain attention that takes explicit masks: DSA's selection is per model layer
        (packed_sdpa and varlen_sdpa too: with no mask, they read the packed documents from the positions like
        the model's layers)."""
        name = model.config._attn_implementation
        self.config._attn_implementation = name if name in ("eager", "packed_sdpa", "varlen_sdpa") else "sdpa"

    def step(self, model, state: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """One draft step over [B, T] positions: its state (`logits` turns the positions that need them into the
        next token's logits: at a real vocabulary the head costs more than the layer)."""
        x = self.proj(torch.cat([self.norm_h(state), self.norm_e(model.get_input_embeddings()(next_ids))], -1))
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids,
                         position_embeddings=model.base_model.rotary_emb(x, position_ids), past_key_values=cache,
                         use_cache=cache is not None)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, model, state: torch.Tensor) -> torch.Tensor:
        """The draft's next-token logits from a step's state, through the model's own head."""
        return model.get_output_embeddings()(self.norm_out(state))

    def __repr__(self) -> str:
        return f"MTP(depth={self.depth}, layer={type(self.layer).__name__})"


def get(model) -> MTP | None:
    return getattr(getattr(model, "module", model), "mtp", None)


def install(model, depth: int):
    """Give `model` an MTP layer of `depth` draft steps (new: a copy of its last layer); kept if it has one."""
    if depth < 1:
        raise ValueError(f"mtp: depth must be >= 1 (got {depth})")
    scaled = list(scaling(model.config))
    head = model.get_output_embeddings()
    if scaled or not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"mtp: {type(model).__name__}'s logits are not its last hidden state times the output "
                         f"embeddings ({scaled or 'a biased or non-linear head'}); the MTP layer shares that head")
    if get(model) is None:
        model.mtp = MTP(model, depth)
        _capture_hooks(model)
    get(model).depth = depth
    setattr(model.config, CONFIG_KEY, {"depth": depth})
    if is_glm5(model):
        model.config.num_nextn_predict_layers = 1
    return model


def restore(model, checkpoint: str | Path | None = None):
    """Reinstall the MTP layer config.json names (`posttrain_mtp`, or a GLM-5 checkpoint's draft layer under
    `num_nextn_predict_layers`), its weights from `checkpoint`; a model without one (or a bare backbone, which has
    no head) is returned as is."""
    settings = getattr(model.config, CONFIG_KEY, None)
    if (not settings and is_glm5(model) and getattr(model.config, "num_nextn_predict_layers", 0) and checkpoint
            and glm5_layer(model, checkpoint, keys_only=True)):
        settings = {"depth": 1}  # a GLM-5 checkpoint's own draft layer (many conversions drop it: then none)
    if not settings or model.get_output_embeddings() is None:
        return model
    install(model, **settings)
    if checkpoint is not None and is_glm5(model):
        _load_glm5_layer(model, checkpoint)
    elif checkpoint is not None:
        load_added_weights(model, checkpoint, lambda k: k.startswith("mtp."), "an MTP layer")
    return model


def _glm5_name(model, key: str) -> str:
    """An MTP tensor's name in GLM-5's layout: `mtp.norm_e.weight` -> `model.layers.<n>.enorm.weight`."""
    ours, theirs = next((a, b) for a, b in GLM5_NAMES if key[4:].startswith(a))
    return f"model.layers.{model.config.num_hidden_layers}.{theirs}{key[4 + len(ours):]}"


def glm5_state(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the MTP layer's tensors under GLM-5's names (layer num_hidden_layers; eh_proj takes
    [embedding, state], ours [state, embedding])."""
    h = model.config.hidden_size
    out = {}
    for k, v in state.items():
        if k.startswith("mtp."):
            k, v = _glm5_name(model, k), (torch.cat([v[:, h:], v[:, :h]], 1) if k == "mtp.proj.weight" else v)
        out[k] = v
    return out


def from_glm5_state(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `glm5_state`: layer num_hidden_layers' tensors under the MTP module's names."""
    prefix, h = f"model.layers.{model.config.num_hidden_layers}.", model.config.hidden_size
    out = {}
    for k, v in state.items():
        if k.startswith(prefix):
            ours, theirs = next((a, b) for a, b in GLM5_NAMES if k[len(prefix):].startswith(b))
            k = f"mtp.{ours}{k[len(prefix) + len(theirs):]}"
            v = torch.cat([v[:, h:], v[:, :h]], 1) if k == "mtp.proj.weight" else v
        out[k] = v
    return out


def glm5_layer(model, checkpoint: str | Path, keys_only: bool = False) -> dict[str, torch.Tensor | None]:
    """A checkpoint's layer num_hidden_layers as stored (names only, read from the file headers, with
    `keys_only`); DeepSeek-V3's copies of the shared embedding and head left out."""
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    raw = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            raw.update({k: None if keys_only else st.get_tensor(k) for k in st.keys() if k.startswith(prefix)
                        and not k[len(prefix):].startswith(("embed_tokens.", "shared_head.head."))})
    return raw


def glm5_layer_state(model, checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's layer num_hidden_layers (GLM-5's names; routed experts one Linear each on disk, as
    transformers writes them) under the MTP module's names, its experts fused as transformers' loader fuses the
    model's layers. Only `model.config` is read."""
    raw = glm5_layer(model, checkpoint)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for k in [k for k in raw if ".experts." in k and k.split(".experts.")[1].split(".")[0].isdigit()]:
        head, rest = k.split(".experts.")
        e, proj = rest.split(".")[:2]
        experts.setdefault(f"{head}.experts.{proj}", {})[int(e)] = raw.pop(k)
    for key, per in experts.items():  # gate_up_proj [E, 2I, H] is each expert's gate rows, then its up rows
        head, proj = key.rsplit(".", 1)
        if proj == "down_proj":
            raw[f"{head}.down_proj"] = torch.stack([per[e] for e in sorted(per)])
        elif proj == "gate_proj" and set(per) == set(up := experts.get(f"{head}.up_proj", {})):
            raw[f"{head}.gate_up_proj"] = torch.stack([torch.cat([per[e], up[e]]) for e in sorted(per)])
    return from_glm5_state(model, raw)


def _load_glm5_layer(model, checkpoint: str | Path) -> None:
    """The MTP layer's weights from a checkpoint's layer num_hidden_layers (`glm5_layer_state`), all or a loud
    error."""
    ours = glm5_layer_state(model, checkpoint)
    want = {k for k in model.state_dict() if k.startswith("mtp.")}
    missing, extra = want - set(ours), set(ours) - want
    if missing or extra:
        raise ValueError(f"{checkpoint}: config.json names a GLM-5 draft layer, but layer "
                         f"{model.config.num_hidden_layers}'s weights hold {len(set(ours) & want)} of its {len(want)} "
                         f"tensors (missing e.g. {sorted(_glm5_name(model, k) for k in missing)[:3]}, unexpected e.g. "
                         f"{sorted(_glm5_name(model, k) for k in extra)[:3]})")
    model.load_state_dict(ours, strict=False)


def _capture_hooks(model) -> None:
    """While `mtp.capture` is set, keep what the training loss needs from the model's own forward: the last
    hidden state and the mask and positions the last layer was given (packed documents included)."""
    mtp = model.mtp
    mtp.capture, mtp.seen = False, {}

    def before_last(_, args, kwargs):
        if mtp.capture:
            mtp.seen.update(mask=kwargs.get("attention_mask"), position_ids=kwargs.get("position_ids"))

    def after_base(_, args, output):
        if mtp.capture:
            mtp.seen["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    _layers(model)[-1].register_forward_pre_hook(before_last, with_kwargs=True)
    model.base_model.register_forward_hook(after_base)


def loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """The MTP loss of the forward the model just ran on `batch` (with `capture` set): the mean over draft steps
    of the cross-entropy of token i + k + 1 where `loss_mask` trains it and it is in token i's document; and each
    step's top-1 accuracy."""
    m = getattr(model, "module", model)
    mtp, seen = m.mtp, m.mtp.seen
    dev = seen["hidden"].device
    ids, mask = batch["input_ids"].to(dev), batch["loss_mask"].to(dev)
    B, T = ids.shape
    pos = seen["position_ids"]
    pos = pos.expand(B, T) if pos is not None else torch.arange(T, device=dev).expand(B, T)
    state, losses, accs = seen["hidden"], [], []
    for k in range(1, mtp.depth + 1):
        if T <= k + 1:
            break
        nxt = F.pad(ids[:, k:], (0, k))                       # token i + k at position i
        target, tmask = F.pad(ids[:, k + 1:], (0, k + 1)), F.pad(mask[:, k + 1:], (0, k + 1)) != 0
        tmask &= F.pad(pos[:, k + 1:] - pos[:, :-k - 1], (0, k + 1)) == k + 1  # not a packed row's next document
        state = mtp.step(m, state, nxt, pos, seen["mask"])
        if not tmask.any():
            continue
        lg = mtp.logits(m, state[tmask]).float()  # only where a target trains (not over prompts or padding)
        losses.append(F.cross_entropy(lg, target[tmask]))
        accs.append((lg.argmax(-1) == target[tmask]).float().mean().item())
    seen.clear()
    if not losses:
        return torch.zeros((), device=dev), accs
    return torch.stack(losses).mean(), accs


def with_loss(loss_fn, weight: float, curves: dict[str, list[float]]):
    """`loss_fn` plus `weight` x the MTP loss as a gradient only (the value stays `loss_fn`'s, comparable with a
    run without MTP); it also trains the model through its hidden states, as in DeepSeek-V3. `curves` collects
    the MTP loss and the first draft step's accuracy (a greedy acceptance estimate). A model without MTP gets
    `loss_fn` unchanged."""
    def fn(model, batch):
        mtp = get(model)
        if mtp is None:
            return loss_fn(model, batch)
        mtp.capture = True
        try:
            main = loss_fn(model, batch)
        finally:
            mtp.capture = False
        aux, accs = loss(model, batch)
        curves.setdefault("mtp_loss", []).append(aux.item())
        if accs:
            curves.setdefault("mtp_acc1", []).append(accs[0])
        return main + weight * (aux - aux.detach())
    return fn
