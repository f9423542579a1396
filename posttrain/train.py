"""The supervised training loop shared by base, ramp and sft: warmup + cosine, the masked LM loss, through a train
engine (posttrain.engines.lm_engine)."""
from __future__ import annotations

import random
from collections.abc import Callable

import torch
from tqdm import tqdm

from posttrain.engines.base import TrainEngine
from posttrain.engines.lm import masked_lm_loss
from posttrain.engines.optim import cosine_schedule
from posttrain.models.moe import SUMMARY
from posttrain.packing import collate

Batch = dict[str, torch.Tensor]


ZERO_LOSS_STEPS = 3


def train(engine: TrainEngine, next_batch: Callable[[int], Batch], *, steps: int, lr: float, warmup: int,
          min_lr_ratio: float = 0.1, grad_clip: float = 1.0, desc: str = "train",
          eval_fn: Callable[[], float] | None = None, eval_every: int = 0, grad_accum: int = 1,
          state: dict | None = None, checkpoint: Callable[[dict], None] | None = None,
          checkpoint_every: int = 0, zero_loss_hint: str = "", stop_fn: Callable[[object], bool] | None = None,
          stop_every: int = 0, **_) -> dict[str, list[float]]:
    """Run `steps` optimizer steps of `engine` (posttrain.engines.lm_engine: its LM loss, balancing, DSA and MTP terms);
    return the history (loss per step, the engine's `step_stats` curves, eval loss when asked).

    Each step takes `grad_accum` micro-batches `next_batch(step * grad_accum + i)`: the data order is a
    function of the step, so resuming from `state` (what `checkpoint` was given) continues exactly.
    A loss of exactly 0 over the first steps means nothing is being trained (an empty loss mask): it stops,
    naming `desc` and `zero_loss_hint`. `stop_fn(engine)`, asked every `stop_every` steps, ends training early when
    it says so (`hist["stopped_at"]`: the steps taken). Keywords of the engine's job (`weight_decay`, ...) are the
    engine's and ignored.
    """
    def schedule(s: int) -> float:
        return cosine_schedule(s, steps, warmup, min_lr_ratio)
    engine = engine.with_schedule(schedule, lr)
    hist: dict[str, list[float]] = {"loss": [], "lr": []}
    start = 0
    if state:
        engine.load_state_dict(state["engine"])
        hist, start = state["hist"], state["step"]
    engine.train()
    bar = tqdm(range(start, steps), desc=desc, mininterval=5, leave=False, initial=start, total=steps)
    for step in bar:
        engine.zero_grad()
        total = 0.0
        for micro in range(grad_accum):
            total += engine.forward_backward(next_batch(step * grad_accum + micro), 1 / grad_accum).item()
        engine.step(grad_clip)
        hist["loss"].append(total)
        for k, v in engine.step_stats().items():
            hist.setdefault(k, []).append(v)
        if len(hist["loss"]) == min(steps, ZERO_LOSS_STEPS) and not any(hist["loss"]):
            raise RuntimeError(f"{desc}: the loss was exactly 0 at each of the first {len(hist['loss'])} steps, so "
                               f"nothing trains (every loss-mask position empty?)"
                               + (f"; {zero_loss_hint}" if zero_loss_hint else ""))
        hist["lr"].append(engine.lr)
        bar.set_postfix(loss=f"{total:.3f}", refresh=False)
        if eval_fn and eval_every and ((step + 1) % eval_every == 0 or step == steps - 1):
            engine.eval()
            hist.setdefault("val_loss", []).append(eval_fn())
            engine.train()
        stop = stop_fn is not None and stop_every and (step + 1) % stop_every == 0 and step < steps - 1
        if stop:
            engine.eval()
            stop = stop_fn(engine)
            engine.train()
        if checkpoint and ((checkpoint_every and (step + 1) % checkpoint_every == 0) or step == steps - 1 or stop):
            checkpoint({"model": engine.weights(), "engine": engine.state_dict(), "hist": hist, "step": step + 1})
        if stop:
            hist["stopped_at"] = [step + 1]
            break
    engine.eval()
    return hist


def pack_stream(docs: list[list[int]], seq_len: int, bos: int, eos: int) -> torch.Tensor:
    """Concatenate bos+doc+eos and cut into rows of `seq_len` (classic pretraining packing)."""
    stream = [t for d in docs for t in [bos, *d, eos]]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


def row_sampler(rows: torch.Tensor, batch_size: int, seed: int) -> Callable[[int], Batch]:
    def next_batch(step: int) -> Batch:
        rng = random.Random(seed * 100_003 + step)
        ids = rows[[rng.randrange(len(rows)) for _ in range(batch_size)]]
        return {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    return next_batch


def pad_examples(examples: list[tuple[list[int], list[int]]], pad_id: int, max_len: int) -> Batch:
    """Right-pad (ids, loss_mask) pairs into a batch, truncating to `max_len`."""
    examples = [(ids[:max_len], m[:max_len]) for ids, m in examples]
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id)
    mask = torch.zeros((len(examples), T), dtype=torch.long)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(m)] = torch.tensor(m)
        attn[i, : len(x)] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def flat_examples(examples: list[tuple[list[int], list[int]]], pad_id: int, max_len: int) -> Batch:
    """(ids, loss_mask) pairs, each truncated to `max_len`, as one row of documents with positions restarting at
    each and no padding: the same loss as `pad_examples`, with nothing computed for padding, for a model whose
    attention reads the documents from the positions (posttrain.models.attention.padding_free)."""
    return collate([[(ids[:max_len], m[:max_len]) for ids, m in examples]], pad_id)


@torch.no_grad()
def eval_loss(model, batches: list[Batch]) -> float:
    return sum(masked_lm_loss(model, b).item() for b in batches) / max(1, len(batches))


def summarize(hist: dict[str, list[float]], key: str = "loss", k: int = 10) -> dict[str, float]:
    """First and last `k`-step means of a curve: the numbers that show a stage learned."""
    xs = hist.get(key, [])
    if not xs:
        return {}
    return {f"{key}_first": sum(xs[:k]) / len(xs[:k]), f"{key}_last": sum(xs[-k:]) / len(xs[-k:])}


def moe_metrics(hist: dict[str, list[float]], k: int = 10) -> dict[str, float]:
    """The expert-load curves' first and last means (a model with routers; {} for a dense one)."""
    return {key: v for c in SUMMARY for key, v in summarize(hist, c, k).items()}

