"""Mixture-of-experts care for GLM-5-shaped models: what transformers' GlmMoeDsaForCausalLM leaves to the trainer.

A router here is any module with GLM-5's / DeepSeek-V3's contract (transformers' `GlmMoeDsaTopkRouter`,
`DeepseekV3TopkRouter`): `forward(h) -> (logits fp32 [N, E], weights [N, k], indices [N, k])` over the N = B*T
tokens of the call, a `top_k`, and an `e_score_correction_bias` buffer that is added to the sigmoid scores for the
choice only. `RouterHooks` puts forward hooks on every router of a model (no monkeypatching) and gives:

- aux-loss-free balancing (DeepSeek-V3 §2.1.2, as GLM-5 trains): after each optimizer step each router's bias
  moves by `rate` toward the mean load, `bias += rate * sign(mean(load) - load)`. The bias is a buffer no optimizer
  sees, so without this it stays at whatever the checkpoint holds;
- expert load per layer over the step's real tokens (padding left out): coefficient of variation, max/mean,
  dead experts;
- DeepSeek-V3's complementary sequence-wise auxiliary loss, `sum_i f_i P_i` per sequence, optional and small;
- routing record and replay for RL: the experts the rollout chose for each token, forced in the trainer's forward
  so that an expert set the trainer would pick differently (another precision, newer weights) does not turn into
  a policy mismatch. The router still gets its gradient through the replayed experts' weights.

No library does these over transformers' modules (Megatron-core does them inside its own MoE layer)."""
from __future__ import annotations

import re

import torch
from torch import nn


def routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every router of the model, in module order (MTP layer included): none for a dense model."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "e_score_correction_bias") and hasattr(m, "top_k")]


def _drafting(name: str) -> bool:
    """Whether a module name is inside an MTP draft layer (`mtp.`, or `module.mtp.` under a DDP wrapper)."""
    return re.match(r"(module\.)?mtp\.", name) is not None


def load_stats(load: torch.Tensor) -> dict[str, float]:
    """Coefficient of variation, max/mean and dead experts (no token) of one layer's expert load."""
    load = load.float()
    mean = load.mean().clamp_min(1e-12)
    return {"cv": float(load.std(unbiased=False) / mean), "max_mean": float(load.max() / mean),
            "dead": int((load == 0).sum())}


def load_summary(per_layer: dict[int, dict[str, float]]) -> dict[str, float]:
    """A step's expert-load figures per MoE layer (`load_stats` by router index) and across layers, under the names
    MLflow and the plot read."""
    per = [per_layer[i] for i in sorted(per_layer)]
    out = {f"moe_{k}_{i}": v for i, s in sorted(per_layer.items()) for k, v in s.items()}
    return out | {"moe_cv": sum(s["cv"] for s in per) / len(per), "moe_max_mean": max(s["max_mean"] for s in per),
                  "moe_dead": sum(s["dead"] for s in per)}


def _rescore(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The router's gate weights for experts `idx`, exactly as its forward computes them for its own choice."""
    w = logits.sigmoid().gather(1, idx)
    if getattr(router, "norm_topk_prob", True):
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * getattr(router, "routed_scaling_factor", 1.0)


class RouterHooks:
    """Hooks on every router of `model`. Loads are counted in forwards with grad enabled (training), summed over
    micro-batches until `after_step`. `record()` / `replay(routes)` switch routing capture and replay on for the
    next forwards; `aux` keeps what `aux_loss()` needs."""

    def __init__(self, model: nn.Module, *, aux: bool = False):
        self.routers = routers(model)
        # routes are recorded and replayed for the model's own layers: an MTP draft layer's router runs outside the
        # model's forward (drafting, its own loss), so it is balanced with the others but has no routes to replay
        self._slot = {i: s for s, i in enumerate(i for i, (n, _) in enumerate(self.routers) if not _drafting(n))}
        self.routed = len(self._slot)
        self.aux = aux
        self.loads = [torch.zeros(r.e_score_correction_bias.numel()) for _, r in self.routers]
        self._aux_terms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]] = []
        self._valid: torch.Tensor | None = None   # real tokens of the current forward, flattened [B*T]
        self._rows = 1
        self.recorded: list[list[torch.Tensor]] | None = None
        self._replay: list[torch.Tensor] | None = None
        self._calls: list[list[torch.Tensor]] | None = None   # replay_calls: one route list per coming forward
        self.replayed = [0, 0]   # [token-layer routes replayed, of them a different expert set than the router's]
        self._handles = []
        if self.routers:
            self._handles.append(model.register_forward_pre_hook(self._see_mask, with_kwargs=True))
            self._handles += [r.register_forward_hook(self._hook(i)) for i, (_, r) in enumerate(self.routers)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _see_mask(self, module, args, kwargs):
        if self._calls is not None:
            self._replay = self._calls.pop(0) if self._calls else None
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        t = ids.shape[-1] if ids is not None else None
        self._rows = ids.shape[0] if ids is not None and ids.dim() == 2 else 1
        self._valid = (mask[:, -t:].reshape(-1).bool() if mask is not None and mask.dim() == 2 and t else None)

    def _hook(self, i: int):
        def hook(router, args, out):
            logits, weights, idx = out
            valid = self._valid if self._valid is not None and self._valid.numel() == idx.shape[0] else None
            slot = self._slot.get(i)
            replay = self._replay if slot is not None else None
            if replay is not None:
                forced = replay[slot]
                if forced.shape != idx.shape:
                    raise ValueError(f"routing replay: router {self.routers[i][0]} got {tuple(forced.shape)} "
                                     f"routes for {tuple(idx.shape)} tokens")
                forced = forced.to(idx.device, idx.dtype)
                fresh = (forced < 0).any(-1, keepdim=True)  # -1: no recorded route, the router chooses
                with torch.no_grad():
                    kept = ~fresh[:, 0] if valid is None else ~fresh[:, 0] & valid
                    same = (forced.sort(-1).values == idx.sort(-1).values).all(-1)
                    self.replayed[0] += kept.sum()  # tensors: no host sync per router call on a GPU
                    self.replayed[1] += (kept & ~same).sum()
                idx = torch.where(fresh, idx, forced)
                weights = _rescore(router, logits, idx)
            if self.recorded is not None and slot is not None:
                self.recorded[slot].append(idx.detach().clone())
            if torch.is_grad_enabled():
                self.loads[i] = count_routes(self.loads[i], idx, valid)
                if self.aux:
                    self._aux_terms.append((logits, idx, valid, self._rows))
            if replay is not None:
                return logits, weights, idx
            return None
        return hook

    # routing record / replay
    def record(self) -> None:
        """Record the experts every router chooses from the next forward on (one [N, k] per router call)."""
        self.recorded = [[] for _ in range(self.routed)]

    def take_recorded(self) -> list[list[torch.Tensor]]:
        out, self.recorded = self.recorded or [], None
        return out

    def take_forward(self) -> torch.Tensor:
        """The routes recorded since `record()`, from one forward: [routers, N, k]; recording goes on."""
        calls = self.take_recorded()
        self.record()
        if any(len(c) != 1 for c in calls):
            raise RuntimeError(f"routing record: expected one call per router, got {[len(c) for c in calls]}")
        return torch.stack([c[0] for c in calls])

    def replay(self, routes: list[torch.Tensor] | None) -> None:
        """Force these experts in the next forwards: per router an [N, k] index tensor for the forward's N tokens,
        rows of -1 left to the router; None ends the replay."""
        if routes is not None and len(routes) != self.routed:
            raise ValueError(f"routing replay: {len(routes)} route tensors for {self.routed} routers")
        self._replay, self._calls = routes, None

    def replay_calls(self, calls: list[list[torch.Tensor]] | None) -> None:
        """Like `replay`, one route list per coming forward of the model, in order (a prefill, then its
        continuation); forwards past the last run unforced. None ends the replay."""
        for routes in calls or []:
            if len(routes) != self.routed:
                raise ValueError(f"routing replay: {len(routes)} route tensors for {self.routed} routers")
        self._replay, self._calls = None, (list(calls) if calls is not None else None)

    def take_replayed(self) -> dict[str, float]:
        """Routes replayed since the last call and the share of them where the router would have chosen other
        experts (the rollout/trainer mismatch replay removed); {} when none were replayed."""
        (n, differ), self.replayed = (int(x) for x in self.replayed), [0, 0]
        return {"routes_replayed": float(n), "routes_differ": differ / n} if n else {}

    # balancing
    def after_step(self, rate: float) -> dict[str, float]:
        """After an optimizer step: the load metrics of the step, then each router's bias moved `rate` toward
        uniform load (sign rule); loads reset. Loads are summed over data-parallel ranks first. {} for a dense
        model or a step that saw no token."""
        if not self.routers:
            return {}
        loads = self.loads
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # every rank reduces, tokens or not (a rank that skipped would hang the others), on the routers' device
            # (NCCL reduces CUDA tensors only)
            loads = [x.to(r.e_score_correction_bias.device) for x, (_, r) in zip(loads, self.routers)]
            for x in loads:
                torch.distributed.all_reduce(x)
        loads = [x.cpu() for x in loads]
        self.loads = [torch.zeros_like(x) for x in self.loads]
        if not any(float(x.sum()) for x in loads):
            return {}
        if rate:
            with torch.no_grad():
                for (_, r), x in zip(self.routers, loads):
                    b = r.e_score_correction_bias
                    b += (rate * torch.sign(x.mean() - x)).to(b.device, b.dtype)
        return load_summary(dict(enumerate(load_stats(x) for x in loads)))

    def aux_loss(self) -> torch.Tensor | None:
        """DeepSeek-V3's sequence-wise balance loss over the forwards since the last call, averaged over routers and
        sequences (rows of the batch; a padding-free row of several documents counts as one): for each sequence,
        `sum_i f_i P_i` with `f_i = E / (k T) * #tokens routed to i` and `P_i` the mean of the normalised sigmoid
        scores. 1.0 at perfect balance. None when nothing was kept (aux off, or a dense model)."""
        terms, self._aux_terms = self._aux_terms, []
        if not terms:
            return None
        total, seqs = (sum(x) for x in zip(*(sequence_balance(*term) for term in terms)))
        return total / seqs.clamp_min(1)


def sequence_balance(logits: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor | None, rows: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One router call's (sum over its `rows` sequences (tokens [N] row-major) of `sum_i f_i P_i`, how many of them
    have a real token (`valid` [N]; None: all real)): `RouterHooks.aux_loss`'s terms. Masked sums rather than each
    sequence's real tokens picked out: no host sync on a GPU."""
    n_exp, k = logits.shape[-1], idx.shape[-1]
    scores = logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    hits = torch.zeros_like(probs).scatter_(1, idx, 1.0)
    rows = rows if idx.shape[0] % rows == 0 else 1
    keep = (torch.ones(idx.shape[0], device=idx.device) if valid is None else valid.float()).view(rows, -1, 1)
    tokens = keep.sum(1)  # [rows, 1]
    f = (hits.view(rows, -1, n_exp) * keep).sum(1) * n_exp / (k * tokens.clamp_min(1))
    p = (probs.view(rows, -1, n_exp) * keep).sum(1) / tokens.clamp_min(1)
    return (f * p).sum(), (tokens > 0).sum()


def count_routes(load: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`load` [experts] plus the experts of `idx` [N, k] at the real tokens (`valid` [N]), on `idx`'s device: an
    index_add of 0/1 weights, where a bincount of the real tokens would wait for the GPU twice per router call
    (its boolean pick and its length)."""
    load = load.to(idx.device)
    w = torch.ones(idx.shape, device=idx.device) if valid is None else valid[:, None].expand(idx.shape).float()
    return load.index_add_(0, idx.reshape(-1), w.reshape(-1))


SUMMARY = ("moe_cv", "moe_max_mean", "moe_dead", "routes_differ")  # a step's figures across layers (and what routing
# replay changed), what curves and MLflow keep

PLOT = "expert_load.png"


def plot_load(hist: dict[str, list[float]], path, title: str) -> bool:
    """Per-layer coefficient of variation and max/mean of the expert load over a stage's steps, and its dead
    experts; False (nothing written) for a dense model's history."""
    layers = sorted(int(m[1]) for k in hist if (m := re.fullmatch(r"moe_cv_(\d+)", k)))
    if not layers:
        return False
    import matplotlib  # heavy, for this figure only; its backend is set before pyplot is imported
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for i in layers:
        for ax, key in zip(axes, ("cv", "max_mean", "dead")):
            ax.plot(hist[f"moe_{key}_{i}"], label=f"router {i}")
    for ax, name in zip(axes, ("coefficient of variation", "max / mean load", "dead experts")):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: expert load per router (0 = uniform)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def with_aux_loss(loss_fn, hooks: RouterHooks, weight: float, curve: list | None = None):
    """`loss_fn` plus `weight` times the routers' auxiliary loss of the same forward, as a gradient only (the value
    stays `loss_fn`'s, comparable with a run without it; the aux value goes to `curve`); `loss_fn` itself where the
    weight is 0 or the model has no router."""
    if not weight or not hooks.routers:
        return loss_fn

    def loss(*args, **kw):
        main = loss_fn(*args, **kw)
        aux = hooks.aux_loss()
        if aux is None:
            return main
        if curve is not None:
            curve.append(float(aux.detach()))
        return main + weight * (aux - aux.detach())
    return loss


class ExpertMLP(nn.Module):
    """One routed expert as plain Linears (gate, up, down: a SwiGLU MLP), named as checkpoints store experts."""

    def __init__(self, hidden: int, inter: int, act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LinearExperts(nn.ModuleList):
    """transformers' fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as one ExpertMLP per expert,
    `experts.{e}.gate_proj` as on disk: what GPTQ's per-Linear Hessians (each expert calibrated on the tokens routed
    to it), compressed-tensors' targets and the integer kernels see. Same forward contract and result."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of `model` by LinearExperts holding the same weights; returns how many."""
    n = 0
    for name, m in list(model.named_modules()):
        w = getattr(m, "gate_up_proj", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            continue
        e, two_i, h = w.shape
        experts = LinearExperts([ExpertMLP(h, two_i // 2, m.act_fn) for _ in range(e)]).to(w.device, w.dtype)
        with torch.no_grad():
            for k, x in enumerate(experts):
                x.gate_proj.weight.copy_(w[k, : two_i // 2])
                x.up_proj.weight.copy_(w[k, two_i // 2:])
                x.down_proj.weight.copy_(m.down_proj[k])
        model.set_submodule(name, experts)
        n += 1
    return n
