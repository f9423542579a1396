"""bench/cuda_shapes: SFT, RL and OPD on CUDA at a real model's shapes (a Qwen2.5-0.5B-shaped model: 24 layers,
896 wide, its 151,936-token vocabulary, random weights), through the pipeline's own code.

- SFT (`posttrain.train.train`, bf16 autocast, fused head kernels): padded batches on sdpa against one
  padding-free row on varlen_sdpa (what `posttrain.stages.sft.collator` picks), the same 16 conversations of 64-1,024
  tokens a step, 30 steps, the last 25 timed; the same on the tiny model of the latest run (32 of 16-256 tokens).
- RL and OPD: the torch rollout engine's plain decoding (32 prompts, 64 new tokens), a teacher (another random
  model) scoring 16 completions sampled and `full`, a GRPO update (`posttrain.rl.step.train_step`) and an OPD update
  (`posttrain.rl.opd_loss.distill_backward`, both forms); and, before any update, how far the trainer's log-probs
  are from the rollout's.
- A GRPO update of a policy on plain sdpa with padded batches, cuDNN's SDPA kept and as posttrain trains (without
  it on Hopper: `posttrain.device.cudnn_sdpa_trusted`): finite or not.

Needs a CUDA device (a 0.5B model on 2 CPU cores would take hours): elsewhere it says so and measures nothing.
Writes `.posttrain/bench/cuda_shapes.json`. The tiny model and its tokenizer (for the pad id) are the base
checkpoint of `.posttrain/latest/report.json` (`BENCH_CUDA_RUN` names another run's report).

BENCH_SMALL=1 (bench/__init__.py): 6 steps (the last 4 timed) of 4 conversations of up to 256 tokens (the tiny
model: 8 of up to 64), 8 prompts of 16 new tokens, one timed repeat; the tiny model and tokenizer are the smoke
run's base checkpoint. Without CUDA it says so and returns, in small mode too.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from bench import mark, out_dir, size, small, smoke_stages

OUT = out_dir()
STEPS, WARM = size(30, 6), size(5, 2)
REPS = size(3, 1)
SMOKE_RUN = torch.cuda.is_available()  # small mode on a GPU starts from the smoke run (bench/__init__.py)
PROMPTS, NEW_TOKENS = size(32, 8), size(64, 16)


def qwen05(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation="sdpa"))


def _base() -> str:
    if small():
        return smoke_stages()["base"]
    report = Path(os.environ.get("BENCH_CUDA_RUN", ".posttrain/latest/report.json"))
    if not report.exists():
        sys.exit(f"bench/cuda_shapes needs the tiny base checkpoint: {report} does not exist; run `make run` first")
    return json.loads(report.read_text())["stages"]["base"]["artifact"]


def _conversations(vocab: int, n: int, lo: int, hi: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        prompt = rng.randint(8, length // 2)
        out.append(([rng.randrange(3, vocab) for _ in range(length)], [0] * prompt + [1] * (length - prompt)))
    return out


def sft(make, batch: int, lo: int, hi: int, dev: torch.device) -> dict:
    """Tokens/s, step time, first/last loss and peak memory, padded on sdpa and padding-free on varlen_sdpa."""
    from posttrain.models import attention
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.train import flat_examples, pad_examples, train
    torch.manual_seed(0)
    vocab = make().config.vocab_size
    batches = [_conversations(vocab, batch, lo, hi, s) for s in range(STEPS)]
    res: dict = {}
    for mode in ("padded_sdpa", "varlen_sdpa"):
        torch.manual_seed(0)
        model = make().to(dev)
        flat = mode == "varlen_sdpa"
        assert not flat or attention.padding_free(model)
        clock = {}

        def next_batch(i: int) -> dict:
            if i == WARM:
                _sync(dev)
                clock["t"] = time.perf_counter()
            return (flat_examples if flat else pad_examples)(batches[i], 0, hi)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        hist = train(TorchTrainEngine.for_lm(model, lr=1e-5), next_batch, steps=STEPS, lr=1e-5, warmup=2, desc=mode)
        _sync(dev)
        seconds = time.perf_counter() - clock["t"]
        tokens = sum(len(x) for b in batches[WARM:] for x, _ in b)
        padded = sum(batch * max(len(x) for x, _ in b) for b in batches[WARM:])
        res[mode] = {"tokens_per_s": tokens / seconds, "step_ms": 1e3 * seconds / (STEPS - WARM),
                     "loss_first": hist["loss"][0], "loss_last": hist["loss"][-1], "peak_gib": _peak(dev),
                     "padding_share": 1 - tokens / padded}
        print(mode, res[mode], flush=True)
        del model
    res["varlen_over_padded"] = res["varlen_sdpa"]["tokens_per_s"] / res["padded_sdpa"]["tokens_per_s"]
    return res


def rl(make, tok, dev: torch.device) -> tuple[dict, list]:
    """The figures, and the 32 rollout samples they trained on (for `padded_policy`)."""
    from posttrain.models import attention
    from posttrain.config import RLConfig
    from posttrain.engines.torch_rollout import TorchRolloutEngine
    from posttrain.engines.torch_train import TorchTrainEngine, policy_logits
    from posttrain.rl.batches import completion_batch
    from posttrain.rl.opd_loss import distill_backward
    from posttrain.rl.step import train_step
    from posttrain.rl.workers import Sample
    out: dict = {}
    vocab = make().config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(PROMPTS)]
    engine = TorchRolloutEngine(make().to(dev), tok)
    gens, s = _timed(lambda: engine.generate(prompts, max_new_tokens=NEW_TOKENS, temperature=1.0, stop_ids=set(),
                                             generator=torch.Generator().manual_seed(0)), dev)
    n = sum(len(g.ids) for g in gens)
    out["rollout"] = {"rows": len(prompts), "tokens": n, "seconds": s, "tokens_per_s": n / s}
    teacher = TorchRolloutEngine(make(1).to(dev), tok)  # another model scores the student's own samples
    items = [(p, g.ids, [1] * len(g.ids)) for p, g in zip(prompts[:PROMPTS // 2], gens)]
    scores = {}
    for mode in ("sampled", "full"):
        scores[mode], out[f"teacher_{mode}_s"] = _timed(lambda: teacher.score(items, mode=mode, temperature=1.0), dev)
    pad = tok.pad_token_id or 0
    model = make()
    assert attention.padding_free(model)  # as TorchTrainEngine.from_checkpoint sets the pipeline's policy
    policy = TorchTrainEngine(model, policy_logits(pad), lr=1e-5, device=dev, pad_id=pad)
    samples = [Sample(f"t{i // 4}", i // 4, p, g.ids, [1] * len(g.ids), g.logprobs, float(rng.random() < 0.5), 0)
               for i, (p, g) in enumerate(zip(prompts, gens))]
    with torch.no_grad():  # before any update: the trainer's log-probs (bf16 autocast on CUDA) against the rollout's
        logp, _ = policy.logprobs(samples, 1.0)
        b = completion_batch(samples, dev)
        diff = logp - b["old_logprobs"]
        out["step0_mean_abs_logp_diff"] = ((diff.abs() * b["mask"]).sum() / b["mask"].sum()).item()
        out["step0_ratio_mean"] = ((diff.exp() * b["mask"]).sum() / b["mask"].sum()).item()
    r = RLConfig(group_size=4, prompts_per_step=PROMPTS // 4, steps=1, val_every=0, stop_check=False, temperature=1.0)
    before = [p.detach().clone() for p in list(model.parameters())[:3]]

    def grpo() -> dict:
        policy.train()
        st = train_step(r, policy, samples)
        policy.eval()
        return st
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    st, s = _timed(grpo, dev)
    out["grpo"] = {"seconds": s, "tokens": sum(len(x.prompt_ids) + len(x.ids) for x in samples),
                   "moved": any(not torch.equal(a, p) for a, p in zip(before, list(model.parameters())[:3])),
                   "peak_gib": _peak(dev), **{k: v for k, v in st.items() if isinstance(v, float)}}
    for mode in ("full", "sampled"):
        sub = [Sample(x.task_id, x.group, x.prompt_ids, x.ids, x.gen_mask, x.logprobs, x.reward, 0, teacher=t)
               for x, t in zip(samples, scores[mode])]

        def opd() -> dict:
            policy.train()
            policy.zero_grad()
            st = distill_backward(policy, sub, mode=mode, temperature=1.0)
            st["grad_norm"] = policy.step(1.0)
            policy.eval()
            return st
        st, s = _timed(opd, dev)
        out[f"opd_{mode}"] = {"seconds": s, **{k: v for k, v in st.items() if isinstance(v, float)}}
    print(out, flush=True)
    return out, samples


def padded_policy(make, tok, dev: torch.device, samples: list) -> dict:
    """A GRPO update on `samples` (rl's) of a policy left on plain sdpa (padded completion batches: prompts
    left-padded, so some query rows see no key) with cuDNN's SDPA kept (POSTTRAIN_CUDNN_SDPA=1) and as posttrain
    trains by default (`posttrain.device.cudnn_sdpa_trusted`): whether the gradient and the updated parameters are
    finite."""
    from posttrain.config import RLConfig
    from posttrain.device import CUDNN_SDPA
    from posttrain.engines.torch_train import TorchTrainEngine, policy_logits
    from posttrain.rl.step import train_step
    r = RLConfig(group_size=4, prompts_per_step=PROMPTS // 4, steps=1, val_every=0, stop_check=False, temperature=1.0)
    pad = tok.pad_token_id or 0
    out = {"capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None}
    before = os.environ.pop(CUDNN_SDPA, None)
    for name in ("cudnn_kept", "posttrain"):
        if name == "cudnn_kept":
            os.environ[CUDNN_SDPA] = "1"
        else:
            os.environ.pop(CUDNN_SDPA, None)
        model = make()
        assert model.config._attn_implementation == "sdpa"
        policy = TorchTrainEngine(model, policy_logits(pad), lr=1e-5, device=dev, pad_id=pad)
        policy.train()
        st = train_step(r, policy, samples)
        out[name] = {"grad_norm": st["grad_norm"],
                     "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
        del model, policy
    if before is not None:
        os.environ[CUDNN_SDPA] = before
    print("padded_policy", out, flush=True)
    return out


def _timed(fn, dev: torch.device, reps: int = REPS):
    fn()  # warm-up: a GPU's first calls load kernels
    _sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        r = fn()
    _sync(dev)
    return r, (time.perf_counter() - t) / reps


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _peak(dev: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0


def run(dev: torch.device, make=qwen05) -> dict:
    from posttrain.models.preset import load_checkpoint
    base = _base()
    _, tok = load_checkpoint(base)
    fig = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "sft_qwen05_shape": sft(make, size(16, 4), 64, size(1024, 256), dev),
           "sft_tiny": sft(lambda: load_checkpoint(base)[0], size(32, 8), 16, size(256, 64), dev)}
    figures, samples = rl(make, tok, dev)
    fig |= {**figures, "padded_policy": padded_policy(make, tok, dev, samples)}
    fig = mark(fig)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cuda_shapes.json").write_text(json.dumps(fig, indent=1))
    return fig


def main() -> None:
    if not torch.cuda.is_available():
        print("bench/cuda_shapes: needs a CUDA device (it trains a 0.5B-shaped model); nothing measured here")
        return
    run(torch.device("cuda"))


if __name__ == "__main__":
    main()
