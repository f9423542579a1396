"""Every kernel against its plain-torch reference at small shapes, forward and backward: the worst absolute
error per check. `python -m kernels.selfcheck` prints them as JSON; `interpreted()` runs that in a child
process under TRITON_INTERPRET=1 (the mode is fixed when triton is imported), which is how a machine without
a GPU checks the Triton code itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kernels import use_triton


def _grads(fn, params, weights):
    outs = fn(*params)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, params)
    return [o.detach() for o in outs], grads


def _worst(a, b) -> float:
    return max((x.double().cpu() - y.double().cpu()).abs().max().item() for x, y in zip(a, b))


def check(device: str = "cpu", seed: int = 0) -> dict[str, float]:
    from kernels.logprob import (linear_logprob, linear_logprob_loss, linear_logprob_reference,
                                 linear_weighted_logprob_loss)
    from kernels.reverse_kl import linear_reverse_kl, linear_reverse_kl_loss, linear_reverse_kl_reference
    g = torch.Generator().manual_seed(seed)
    out: dict[str, float] = {}
    # vocab 2500: blocks of 1024 with a ragged last; 37 tokens in chunks of 8 with a ragged last
    n, d, v, temp = 37, 16, 2500, 0.7
    h = torch.randn(n, d, generator=g).to(device).requires_grad_()
    w = torch.randn(v, d, generator=g).to(device).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g).to(device)
    weights = [torch.randn(n, generator=g, dtype=torch.float64).to(device) for _ in range(2)]
    ref_out, ref_grad = _grads(lambda a, b: linear_logprob_reference(a, b, target, temp), [h, w], weights)
    got_out, got_grad = _grads(lambda a, b: linear_logprob(a, b, target, temp, chunk_tokens=8), [h, w], weights)
    out["logprob_forward"], out["logprob_backward"] = _worst(got_out, ref_out), _worst(got_grad, ref_grad)
    teacher = torch.log_softmax(torch.randn(n, v, generator=g), -1).to(device)
    ref_out, ref_grad = _grads(lambda a, b: linear_reverse_kl_reference(a, b, teacher, temp), [h, w], weights[:1])
    got_out, got_grad = _grads(lambda a, b: linear_reverse_kl(a, b, teacher, temp, chunk_tokens=8), [h, w],
                               weights[:1])
    out["reverse_kl_forward"], out["reverse_kl_backward"] = _worst(got_out, ref_out), _worst(got_grad, ref_grad)
    out.update(_check_losses(device, g, h, w, target, teacher, temp, linear_logprob_reference, linear_logprob_loss,
                             linear_reverse_kl_reference, linear_reverse_kl_loss, linear_weighted_logprob_loss))
    out.update(_check_w4a8(device, g))
    out.update(_check_dsa(device, g))
    out["triton"] = float(use_triton(h))
    return out


def _check_losses(device, g, h, w, target, teacher, temp, lp_ref, lp_loss, kl_ref, kl_loss,
                  weighted_loss) -> dict[str, float]:
    """The gradient-in-forward forms on a per-token loss like the RL policy's (clipped ratio, advantages, an
    entropy bonus), a weighted KL and a weighted NLL with an entropy term, the loss scaled afterwards (gradient
    accumulation): loss and gradients."""
    n = h.size(0)
    adv, old, wt = (torch.randn(n, generator=g).to(device) for _ in range(3))

    def policy(lp, ent, rows):
        ratio = torch.exp(lp - old[rows] - 4)
        return (-torch.minimum(ratio * adv[rows], ratio.clamp(0.8, 1.2) * adv[rows]) - 0.01 * ent).sum() / n

    def kl_term(kl, rows):
        return (kl * wt[rows]).sum()

    def linear(lp, ent):
        return -(lp * wt).sum() + (ent * adv).sum()
    out = {}
    for name, ref, got in (
            ("logprob_loss", lambda a, b: policy(*lp_ref(a, b, target, temp), slice(None)),
             lambda a, b: lp_loss(a, b, target, policy, temp, chunk_tokens=8)[0]),
            ("reverse_kl_loss", lambda a, b: kl_term(kl_ref(a, b, teacher, temp), slice(None)),
             lambda a, b: kl_loss(a, b, teacher, kl_term, temp, chunk_tokens=8)[0]),
            # SFT's weighted NLL with an entropy term: the one-kernel form of known coefficients
            ("logprob_weighted_loss", lambda a, b: linear(*lp_ref(a, b, target, temp)),
             lambda a, b: weighted_loss(a, b, target, -wt, adv, temp, chunk_tokens=8)[0])):
        want = ref(h, w) * 3
        have = got(h, w) * 3
        out[name] = max(_worst([have.detach()], [want.detach()]),
                        _worst(torch.autograd.grad(have, [h, w]), torch.autograd.grad(want, [h, w])))
    return out


def _check_w4a8(device: str, g: torch.Generator) -> dict[str, float]:
    """The W4A8 GEMM in its three weight layouts ("nk" at K 96, "planes" at K 512 with groups of 32, 128 and 512,
    "bytes" with groups of 64 and 256, its transposed product and inline PTX where compiled) on pre-quantized
    activations (split-K 1 and 2), with the quantization in its prologue, the one-launch quantization, the grouped
    launch over experts (one with no rows), and the model's layer."""
    from kernels.w4a8 import (kernel_layout, pack_int4, quantize_activations, quantize_activations_fused,
                              w4a8_grouped, w4a8_grouped_reference, w4a8_linear, w4a8_matmul, w4a8_reference)
    triton_here = use_triton(torch.empty(0, device=device))
    out: dict[str, float] = {"w4a8": 0.0, "w4a8_fused_quant": 0.0, "w4a8_grouped": 0.0} if triton_here else {}
    m, cols, experts = 5, 70, 4
    offsets = torch.tensor([0, 3, 3, 20, 23])
    cases = ((96, 32, "nk"), (512, 32, "planes"), (512, 128, "planes"), (512, 512, "planes"), (512, 64, "bytes"),
             (512, 256, "bytes"))
    for k, group, layout in cases if triton_here else ():
        q = torch.randint(-8, 8, (cols, k), generator=g, dtype=torch.int8)
        scales = torch.rand(cols, k // group, generator=g) * 0.01
        x = torch.randn(m, k, generator=g)
        xq, sx = quantize_activations(x)
        ref = w4a8_reference(xq, sx, pack_int4(q), scales)
        qe = torch.randint(-8, 8, (experts, cols, k), generator=g, dtype=torch.int8)
        se = torch.rand(experts, cols, k // group, generator=g) * 0.01
        xe = torch.randn(23, k, generator=g)
        ref_e = w4a8_grouped_reference(xe, offsets, pack_int4(qe), se)
        packed = kernel_layout(pack_int4(q).to(device), layout)
        xd, sd = x.to(device), scales.to(device)
        out["w4a8"] = max(out["w4a8"], *(_worst([w4a8_matmul(xq.to(device), sx.to(device), packed, sd, config=dict(
            SPLIT_K=split, layout=layout, swap=split == 2, asm=True))], [ref]) for split in (1, 2)))
        out["w4a8_fused_quant"] = max(out["w4a8_fused_quant"], *(_worst([w4a8_linear(xd, packed, sd, config=dict(
            SPLIT_K=split, fuse_quant=True, layout=layout, swap=split == 3))], [ref]) for split in (1, 3)))
        x70 = torch.randn(70, k, generator=g)  # 64-row tiles (the tensor cores' wgmma shape on Hopper)
        out["w4a8_64_rows"] = max(out.get("w4a8_64_rows", 0.0), _worst(
            [w4a8_linear(x70.to(device), packed, sd, config=dict(BM=64, BN=64, SPLIT_K=1, layout=layout, swap=True))],
            [w4a8_reference(*quantize_activations(x70), pack_int4(q), scales)]))
        out["quantize_activations"] = _worst(quantize_activations_fused(xd), (xq, sx.to(device)))
        pe = kernel_layout(pack_int4(qe).to(device), layout)
        xed, od, sed = xe.to(device), offsets.to(device), se.to(device)
        out["w4a8_grouped"] = max(out["w4a8_grouped"], *(_worst([w4a8_grouped(xed, od, pe, sed, config=dict(
            SPLIT_K=split, fuse_quant=f, layout=layout, swap=f, asm=True))], [ref_e]) for split in (1, 2)
            for f in (False, True)))
    try:  # the model's layer (kernel or _int_mm); it loads checkpoints through compressed-tensors, not on every GPU box
        from posttrain.quant.int_matmul import IntLinear
    except ImportError:
        return out
    for k, group in ((96, 32), (512, 128)):
        q = torch.randint(-8, 8, (cols, k), generator=g, dtype=torch.int8)
        scales = torch.rand(cols, k // group, generator=g) * 0.01
        x = torch.randn(m, k, generator=g)
        ref = w4a8_reference(*quantize_activations(x), pack_int4(q), scales)
        layer = IntLinear(q, scales, act_bits=8, weight_bits=4)
        out["int_linear"] = max(out.get("int_linear", 0.0), _worst([layer.to(device)(x.to(device))], [ref]))
    out["int_experts"] = _check_int_experts(device, g)
    return out


def _check_int_experts(device: str, g: torch.Generator) -> float:
    """A W4A8 MoE layer's routed experts: the grouped launches (where the kernel runs) against the loop over experts,
    4 experts (one never routed to), 7 tokens with 2 experts each."""
    from posttrain.models.moe import ExpertMLP, LinearExperts
    from posttrain.quant.int_experts import IntExperts
    from posttrain.quant.int_matmul import IntLinear
    hidden, inter, experts = 256, 256, 4

    def int_linear(n, k):
        return IntLinear(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8),
                         torch.rand(n, k // 128, generator=g) * 0.01, act_bits=8, weight_bits=4)
    mlps = []
    for _ in range(experts):
        mlp = ExpertMLP(hidden, inter, torch.nn.functional.silu)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = int_linear(inter, hidden), int_linear(inter, hidden), \
            int_linear(hidden, inter)
        mlps.append(mlp)
    x = torch.randn(7, hidden, generator=g).to(device)
    idx = torch.stack([torch.randperm(experts - 1, generator=g)[:2] for _ in range(7)]).to(device)
    weights = torch.rand(7, 2, generator=g).to(device)
    want = LinearExperts(mlps).to(device)(x, idx, weights)
    return _worst([IntExperts(mlps).to(device)(x, idx, weights)], [want])


def _check_dsa(device: str, g: torch.Generator) -> dict[str, float]:
    """DSA's indexer top-k (compared by the scores it selected: equal scores may tie in any order) under a causal
    and a document mask, top_k not a power of 2; sparse attention with GQA and rows selecting fewer than top_k."""
    from kernels import dsa
    out: dict[str, float] = {}
    b, lq, lk, hi, d, top_k = 2, 20, 33, 2, 16, 12
    qi, w = torch.randn(b, lq, hi, d, generator=g), torch.randn(b, lq, hi, generator=g)
    ki = torch.randn(b, lk, d, generator=g)
    docs = (torch.rand(b, lq, lk, generator=g) > 0.3) & dsa.causal(lq, lk)
    scores = dsa.indexer_scores(qi, w, ki)

    def picked(idx):  # each query's selected scores, sorted; -1 entries count as -1e9
        return [scores.gather(-1, idx.cpu().long().clamp(min=0)).masked_fill(idx.cpu() < 0, -1e9).sort(-1).values]
    out["dsa_topk"] = max(_worst(picked(dsa.indexer_topk(*(t.to(device) for t in (qi, w, ki)),  # 2 query chunks
                                                         None if a is None else a.to(device), top_k, 4 * b * lk * 16)),
                                 picked(dsa.indexer_topk_reference(qi, w, ki, a, top_k))) for a in (None, docs))
    h, hkv = 4, 2
    q = torch.randn(b, h, lq, d, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(b, hkv, lk, d, generator=g).to(device).requires_grad_() for _ in range(2))
    idx = dsa.indexer_topk_reference(qi, w, ki, docs, top_k).to(device)
    weights = [torch.randn(b, h, lq, d, generator=g, dtype=torch.float64).to(device)]
    ref_out, ref_grad = _grads(lambda *t: dsa.sparse_attention_reference(*t, idx, 0.25), [q, k, v], weights)
    got_out, got_grad = _grads(lambda *t: dsa.sparse_attention(*t, idx, 0.25), [q, k, v], weights)
    out["dsa_attention_forward"], out["dsa_attention_backward"] = _worst(got_out, ref_out), _worst(got_grad, ref_grad)
    return out


def interpreted(timeout: float = 600) -> dict[str, float]:
    """`check("cpu")` in a child process with TRITON_INTERPRET=1 (the Triton code, interpreted on CPU, also on a
    machine with a GPU)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "kernels.selfcheck", "cpu"], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"kernels.selfcheck under TRITON_INTERPRET=1 failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # python -m kernels.selfcheck [cpu|cuda] (default: cuda where present)
    print(json.dumps(check(sys.argv[1] if len(sys.argv) > 1 else "cuda" if torch.cuda.is_available() else "cpu")))
