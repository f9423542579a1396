"""Scoring base models (before sft) the way the pretraining corpus shows tasks: as plain-text completion.

A model that has never seen the chat template cannot be judged through it (lm-eval-harness scores base
models the same way). The prompt is `Task.prose_prompt`, greedy decoding, and the text after "Answer:"
goes to the environment's own verifier.
"""
from __future__ import annotations

import torch

import environments
from environments.base import Task
from posttrain.chat import bos_ids, doc_end_id
from posttrain.engines import as_rollout_engine


def extract_answer(completion: str, thinking: bool) -> str:
    if thinking:  # the reasoning must end in "Answer:"
        completion = completion.split("Answer:", 1)[1] if "Answer:" in completion else ""
    text = completion.split("Question:", 1)[0].strip()  # the corpus runs on into the next worked example
    return text[:-1] if text.endswith(".") else text


@torch.no_grad()
def completion_scores(engine, tok, tasks: list[Task], *, thinking: bool = True, max_new_tokens: int = 48,
                      batch_size: int = 64) -> tuple[list[float], list[int]]:
    """Per task: verifier reward in [0, 1] and generated tokens (`engine`: a rollout engine or a model)."""
    engine, eos = as_rollout_engine(engine, tok), doc_end_id(tok)
    prompts = [[*bos_ids(tok), *tok(t.prose_prompt(thinking), add_special_tokens=False)["input_ids"]]
               for t in tasks]
    outs = []
    for i in range(0, len(prompts), batch_size):
        outs += engine.generate(prompts[i:i + batch_size], max_new_tokens=max_new_tokens, temperature=0.0,
                                stop_ids={eos})
    rewards = [environments.get(t.domain).verify(t, extract_answer(tok.decode(g.ids, skip_special_tokens=True),
                                                                   thinking))[0]
               for t, g in zip(tasks, outs)]
    return rewards, [len(g.ids) for g in outs]
