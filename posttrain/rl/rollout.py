"""Multi-turn episodes against an environment's tools, generated through a rollout engine (token in, token
out: the ids and logprobs the engine produced, never re-tokenised)."""
from __future__ import annotations

import torch

from environments.base import Task
from environments.episode import Episode
from posttrain.chat import chat_format
from posttrain.engines import as_rollout_engine


def run_episodes(engine, tok, tasks: list[Task], *, enable_thinking: bool = True, thinking_turns: str = "all",
                 max_new_tokens: int = 48, temperature: float = 0.0, max_turns: int = 3,
                 generator: torch.Generator | None = None, batch_size: int = 64, judge=None, context_budget: int = 0,
                 compaction: bool = True, summary: str = "rules") -> list[Episode]:
    """Roll out each task through the environments' step API, batching the engine across episodes; with a
    `context_budget`, episodes compact (or, with `compaction` off, end) where their next turn would not fit, carrying
    over the rule-based note or, with `summary="policy"`, the notes the policy writes when asked.
    `thinking_turns`: which turns think when thinking is on (environments.episode); `judge`: the guard's second
    stage (environments.sandbox).

    `engine` is a RolloutEngine (posttrain.engines), or a torch model used as one in this process."""
    engine = as_rollout_engine(engine, tok)
    fmt = chat_format(tok)
    episodes = [Episode(t, tok, enable_thinking=enable_thinking, thinking_turns=thinking_turns, max_turns=max_turns,
                        judge=judge, context_budget=context_budget, compaction=compaction, summary=summary,
                        max_new_tokens=max_new_tokens) for t in tasks]
    try:
        for e in episodes:
            e.reset()
        active = list(range(len(episodes)))
        while active:
            results = []
            for s in range(0, len(active), batch_size):
                chunk = active[s:s + batch_size]
                results += engine.generate([episodes[i].prompt_ids + episodes[i].ids for i in chunk],
                                           max_new_tokens=max_new_tokens, temperature=temperature,
                                           stop_ids=set(fmt.stop_ids), generator=generator)
            active = [i for i, g in zip(active, results)
                      if not episodes[i].step(g.ids, g.logprobs, g.routes, g.versions).done]
    finally:
        for e in episodes:
            e.close()
    return episodes


def score(episodes: list[Episode]) -> list[float]:
    return [e.reward for e in episodes]


def episode_batch(episodes: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion ids, with the mask and rollout logprobs aligned to targets.

    Position j of `mask`/`old_logprobs` refers to the token predicted by logits[:, j] (= ids[:, j+1]).
    """
    seqs = [e.prompt_ids + e.ids for e in episodes]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    mask = torch.zeros((len(seqs), T - 1))
    old = torch.zeros((len(seqs), T - 1))
    for i, (e, s) in enumerate(zip(episodes, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        p = len(e.prompt_ids) - 1
        mask[i, p: p + len(e.ids)] = torch.tensor(e.gen_mask, dtype=torch.float)
        old[i, p: p + len(e.ids)] = torch.tensor(e.logprobs)
    return {"input_ids": ids, "attention_mask": attn, "mask": mask, "old_logprobs": old}


def token_logits(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """Logits for every target position, at the sampling temperature so logprobs match the rollout's."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def mean_score(model, tok, tasks: list[Task], **kw) -> float:
    eps = run_episodes(model, tok, tasks, temperature=0.0, **kw)
    return sum(score(eps)) / max(1, len(eps))
