"""sft: chat-template demonstrations with thinking on or off per conversation; assistant-only loss."""
from __future__ import annotations

import random
from pathlib import Path

import environments
from environments import long_context
from environments.base import Task
from posttrain.chat import render_with_mask
from posttrain.config import PipelineConfig
from posttrain.curate import load_tasks
from posttrain.model import load_checkpoint, save_checkpoint, seed_all
from posttrain.train import eval_loss, pad_examples, summarize, train


def conversation(task: Task, thinking: bool) -> list[dict]:
    """The task's demonstration; with thinking off every assistant turn has an empty think block."""
    demo = [m if thinking or m["role"] != "assistant" else {**m, "reasoning_content": ""} for m in task.demo]
    return task.messages() + demo


def build_examples(cfg: PipelineConfig, tok, tasks: list[Task], seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [render_with_mask(tok, conversation(t, rng.random() >= cfg.sft.nothink_share)) for t in tasks]


def _long_tasks(tok, split: str, n: int, seed: int, max_len: int) -> list[Task]:
    def count(t):
        return len(render_with_mask(tok, conversation(t, True))[0])
    lengths = [max_len // 4, max_len // 2, max_len]
    return [t for i, L in enumerate(lengths) for t in long_context.fit_to_length(split, n // 3, seed + i, L, count)]


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    s = cfg.sft
    model, tok = load_checkpoint(inputs["ramp"])
    domains = environments.names(cfg.world.environments)
    train_tasks = [t for d in domains for t in load_tasks(inputs["curate"], "sft", d)]
    long_tasks = _long_tasks(tok, "train", len(train_tasks) // 6, cfg.seed, s.seq_len)
    train_tasks += long_tasks
    val_tasks = [t for d in domains for t in load_tasks(inputs["curate"], "val", d)]
    examples = build_examples(cfg, tok, train_tasks, cfg.seed)
    val = build_examples(cfg, tok, val_tasks, cfg.seed + 1)
    val_batches = [pad_examples(val[i:i + s.batch_size], tok.pad_token_id, s.seq_len)
                   for i in range(0, len(val), s.batch_size)]

    # length buckets: a batch pads to its longest row, so one long-context example would make the
    # whole batch 512 tokens wide
    buckets: dict[int, list] = {}
    for ex in examples:
        buckets.setdefault(min(s.seq_len, 1 << max(6, (len(ex[0]) - 1).bit_length())), []).append(ex)
    keys = sorted(buckets)

    def next_batch(step: int):
        rng = random.Random(cfg.seed * 31 + step)
        bucket = buckets[rng.choices(keys, weights=[len(buckets[k]) for k in keys])[0]]
        return pad_examples([bucket[rng.randrange(len(bucket))] for _ in range(s.batch_size)],
                            tok.pad_token_id, s.seq_len)

    hist = train(model, next_batch, steps=s.steps, lr=s.lr, warmup=s.warmup, min_lr_ratio=s.min_lr_ratio,
                 weight_decay=s.weight_decay, grad_clip=s.grad_clip, desc="sft",
                 eval_fn=lambda: eval_loss(model, val_batches), eval_every=max(1, s.steps // 5))
    save_checkpoint(model, tok, out)
    n_tok = sum(sum(m) for _, m in examples)
    return {"metrics": {"examples": len(examples), "long_context_examples": len(long_tasks),
                        "assistant_tokens": n_tok, **summarize(hist),
                        **summarize(hist, "val_loss", 1)}, "history": hist}
