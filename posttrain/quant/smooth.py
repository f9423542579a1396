"""Activation-aware scales folded in before W4A8 rounding (`quantize.smooth`).

X W^T = (X / s)(W diag(s))^T for any per-channel s > 0. Folding 1/s into what produces X (the RMSNorm before q, k,
v or gate, up; the up projection before down) leaves the float model as it was, while the int8 activations and the
int4 or int8 weights round X / s and W diag(s). SmoothQuant (Xiao et al. 2023) sets s = max|X|^a / max|W|^(1-a);
AWQ (Lin et al. 2024) searches a per layer on the quantized output's error. This does both: for each fold, a from
`ALPHAS` or no scaling at all, whichever rounds the calibration activations' outputs best (round to nearest at the
Linear's own bits and group size, int8 activations per token), so a fold is never scaled to a larger error.

Written here because llm-compressor's SmoothQuant and AWQ modifiers pin an older transformers and compressed-tensors
than ours (as for GPTQ, posttrain/quant/gptq.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from posttrain.quant.gptq import rtn
from posttrain.quant.layerwise import through

ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MAX_TOKENS = 2048  # calibration tokens a fold's search rounds (sampled with a fixed generator)


@dataclass
class Fold:
    """`prev` (a norm's weight, or a Linear's output rows) produces the input every Linear of `nexts` reads."""
    prev: nn.Module
    nexts: list[tuple[str, nn.Linear, int, int]]  # name, module, weight bits, group size

    @property
    def name(self) -> str:
        return f"{self.nexts[0][0].rsplit('.', 1)[0]}: {', '.join(n.rsplit('.', 1)[-1] for n, *_ in self.nexts)}"


def folds(layer: nn.Module, found: dict[str, tuple[nn.Linear, int, int]], glm5: bool) -> list[Fold]:
    """The folds of one decoder layer whose Linears are all quantization targets (`found`, scheme.targets): every
    SwiGLU MLP's up -> down (the dense MLP, each routed expert, the shared expert); in a dense model also the input
    norm -> q, k, v and the post-attention norm -> gate, up. GLM-5's norms also feed its router and DSA indexer (and
    MLA's latent projections their own norms), which stay 16-bit: they are not folded into."""
    by_module = {id(m): (n, m, b, g) for n, (m, b, g) in found.items()}

    def quantized(*mods) -> list | None:
        got = [by_module.get(id(m)) for m in mods]
        return got if all(got) else None
    out = []
    for m in layer.modules():
        if all(isinstance(getattr(m, k, None), nn.Linear) for k in ("gate_proj", "up_proj", "down_proj")):
            if nexts := quantized(m.down_proj):
                out.append(Fold(m.up_proj, nexts))
    if not glm5:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is not None and (nexts := quantized(*(getattr(attn, k, None) for k in ("q_proj", "k_proj", "v_proj")))):
            out.append(Fold(layer.input_layernorm, nexts))
        if mlp is not None and (nexts := quantized(getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None))):
            out.append(Fold(layer.post_attention_layernorm, nexts))
    return out


def _fake_act(x: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    s = (x.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-8)
    return torch.round(x / s).clamp(-qmax - 1, qmax) * s


def _fake_weight(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    q, s = rtn(w, bits, group, torch.bfloat16)
    return (q.float().reshape(q.shape[0], -1, group) * s[..., None]).reshape(w.shape)


def output_error(x: torch.Tensor, fold: Fold, s: torch.Tensor | None, act_bits: int) -> float:
    """Sum over the fold's Linears of the W4A8-rounded outputs' squared error on `x` relative to each token's own
    output, averaged over tokens, with the scales `s` applied (None: as the model is). Per token: a few tokens with
    massive activations (the attention sink) would otherwise be most of a summed error, and scales chosen for them
    cost every ordinary token (measured on SmolLM2: lower KL on its own answers, 10 of 47 everyday answers lost)."""
    xs = _fake_act(x if s is None else x / s, act_bits)
    err = 0.0
    for _, m, bits, g in fold.nexts:
        w = m.weight.float()
        ref = x @ w.T
        got = xs @ _fake_weight(w if s is None else w * s, bits, g).T
        err += (((got - ref) ** 2).sum(-1) / (ref ** 2).sum(-1).clamp(min=1e-30)).mean().item()
    return err


def search(x: torch.Tensor, fold: Fold, act_bits: int) -> tuple[torch.Tensor | None, float | None, float, float]:
    """(scales or None, their alpha, the error without scales, the error with the chosen ones) for one fold."""
    x = x.float()
    ax = x.abs().amax(0).clamp(min=1e-5)
    aw = torch.cat([m.weight.detach().float() for _, m, _, _ in fold.nexts]).abs().amax(0).clamp(min=1e-5)
    plain = best = output_error(x, fold, None, act_bits)
    chosen, alpha = None, None
    for a in ALPHAS:
        s = ax ** a / aw ** (1 - a)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1: the folded norm and weights keep their magnitudes
        if (e := output_error(x, fold, s, act_bits)) < best:
            best, chosen, alpha = e, s, a
    return chosen, alpha, plain, best


@torch.no_grad()
def apply(fold: Fold, s: torch.Tensor) -> None:
    """Fold 1/s into `prev` and s into every Linear of `nexts` (the float model computes the same function)."""
    prev = fold.prev
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))
    for _, m, _, _ in fold.nexts:
        m.weight.mul_(s[None, :].to(m.weight.dtype))


class InputSampler:
    """Collects the inputs of each fold's first Linear over forward passes; `take` returns up to MAX_TOKENS of them."""

    def __init__(self, layer_folds: list[Fold]):
        self.seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layer_folds))}
        self.handles = [f.nexts[0][1].register_forward_pre_hook(self._hook(i)) for i, f in enumerate(layer_folds)]

    def _hook(self, i: int):
        def hook(_module, args):
            self.seen[i].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return hook

    def take(self, i: int, seed: int = 0) -> torch.Tensor | None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if not self.seen[i]:  # a routed expert no calibration token reached
            return None
        x = torch.cat(self.seen[i])
        if len(x) > MAX_TOKENS:
            x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:MAX_TOKENS]]
        return x


def check_unchanged(before: torch.Tensor, after: torch.Tensor, where: str) -> None:
    """A fold must leave the float model's function as it was: a norm of another form (Gemma's 1 + weight) would
    not. Refuse loudly rather than quantize a different model."""
    rel = ((before - after).norm() / before.norm().clamp(min=1e-30)).item()
    if rel > 1e-3:  # float32 rounding of a rescaled product is ~1e-6 of it
        raise RuntimeError(f"quantize.smooth: folding the scales into {where} changed its output by {rel:.2e} "
                           f"(relative): this layer's norm is not a plain per-channel scale. Set "
                           f"quantize.smooth: false for this model")


@torch.no_grad()
def smooth_layer(layer: nn.Module, index: int, found: dict[str, tuple[nn.Linear, int, int]], glm5: bool,
                 hidden: list[torch.Tensor], kwargs: list[list[dict]], act_bits: int) -> list[dict]:
    """Search and fold every fold of one decoder layer on its calibration inputs (`hidden`, with each batch's layer
    keyword arguments); returns a record per fold (its alpha, or None where no scaling rounded better)."""
    layer_folds = folds(layer, found, glm5)
    if not layer_folds:
        return []
    sampler = InputSampler(layer_folds)
    # one pass over every batch fills the sampler; its first batch's output is what the folds must leave unchanged
    before = [through(layer, h, kw[index]) for h, kw in zip(hidden, kwargs)][0]
    records = []
    for i, fold in enumerate(layer_folds):
        x = sampler.take(i, seed=index)
        if x is None:
            records.append({"layer": index, "fold": fold.name, "alpha": None, "tokens": 0})
            continue
        s, alpha, plain, best = search(x, fold, act_bits)
        if s is not None:
            apply(fold, s)
        records.append({"layer": index, "fold": fold.name, "alpha": alpha, "tokens": len(x),
                        "error": round(plain, 6), "error_smoothed": round(best, 6)})
    check_unchanged(before, through(layer, hidden[0], kwargs[0][index]), f"decoder layer {index}")
    return records


def summary(records: list[dict]) -> dict:
    """What report.json's quantization figures say of the smoothing: folds scaled, alphas chosen, the rounded
    outputs' mean relative error before and after."""
    searched = [r for r in records if "error" in r]
    alphas: dict[str, int] = {}
    for r in searched:
        key = "none" if r["alpha"] is None else f"{r['alpha']:.1f}"
        alphas[key] = alphas.get(key, 0) + 1

    def mean(key: str) -> float:
        return round(sum(r[key] for r in searched) / max(1, len(searched)), 6)
    return {"folds": len(records), "folds_scaled": sum(r["alpha"] is not None for r in searched),
            "alphas": dict(sorted(alphas.items())), "mean_output_error": mean("error"),
            "mean_output_error_smoothed": mean("error_smoothed")}
