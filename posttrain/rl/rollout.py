"""The local rollout engine: batched sampling with a KV cache, returning the exact token ids and
logprobs produced (token in, token out), and multi-turn episodes against an environment's tools."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from environments.base import Task
from environments.episode import Episode
from environments.sandbox import path_judge
from posttrain.chat import chat_format


def prefill_distinct(model, prompts: list[list[int]], pad_id: int):
    """Run each distinct prompt once (left-padded) and index its KV cache out to every row that has it.

    Returns (the model's output for the distinct prompts, the per-row cache, the per-row attention mask,
    `which`: row -> distinct prompt). Groups of samples share a prompt; this is where they share its work."""
    uniq: dict[tuple[int, ...], int] = {}
    which = torch.tensor([uniq.setdefault(tuple(p), len(uniq)) for p in prompts])
    L = max(map(len, uniq))
    ids = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in uniq])
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in uniq])
    cache = DynamicCache()
    # a causal LM computes logits only where they are used: the prompt's last position
    extra = {"logits_to_keep": 1} if hasattr(model, "lm_head") else {}
    out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache, use_cache=True, **extra)
    cache.batch_select_indices(which)
    return out, cache, attn[which], which


@torch.no_grad()
def sample(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, stop_ids: set[int],
           pad_id: int, generator: torch.Generator | None = None) -> list[tuple[list[int], list[float]]]:
    """Generate for a batch of token-id prompts; temperature 0 is greedy. Returns (ids, logprobs).

    Identical prompts (a GRPO group) are prefilled once and share their KV cache; finished rows leave
    the batch once an eighth of it has finished, so the cost follows the unfinished rows."""
    out, cache, attn, which = prefill_distinct(model, prompts, pad_id)
    logits = out.logits[:, -1].float()[which]
    rows = torch.arange(len(prompts))          # batch row -> prompt index
    live = torch.ones(len(prompts), dtype=torch.bool)
    out_ids, out_lp = [[] for _ in prompts], [[] for _ in prompts]
    stop = torch.tensor(sorted(stop_ids))
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
        if temperature > 0:  # Gumbel-max: an exact draw from softmax(logp), cheaper than multinomial
            nxt = (logp - torch.empty_like(logp).exponential_(generator=generator).log()).argmax(-1)
        else:
            nxt = logits.argmax(-1)
        lp = logp.gather(1, nxt[:, None]).squeeze(1)
        for r, n, x in zip(rows[live].tolist(), nxt[live].tolist(), lp[live].tolist()):
            out_ids[r].append(n)
            out_lp[r].append(x)
        live &= ~torch.isin(nxt, stop)
        if not live.any() or t == max_new_tokens - 1:
            break
        if (~live).sum() * 8 >= len(rows):
            keep = live.nonzero().flatten()
            cache.batch_select_indices(keep)
            attn, rows, nxt, live = attn[keep], rows[keep], nxt[keep], live[keep]
        attn = torch.cat([attn, live.long()[:, None]], 1)
        logits = model(input_ids=torch.where(live, nxt, pad_id)[:, None], attention_mask=attn,
                       position_ids=(attn.sum(-1) - 1)[:, None], past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
    return list(zip(out_ids, out_lp))


def run_episodes(model, tok, tasks: list[Task], *, enable_thinking: bool = True, max_new_tokens: int = 48,
                 temperature: float = 0.0, max_turns: int = 3, generator: torch.Generator | None = None,
                 batch_size: int = 64, judge=path_judge) -> list[Episode]:
    """Roll out each task through the environments' step API, batching the model across episodes.

    `model` is a torch model or an engine with `generate(prompts, **sampling)` (posttrain.rl.workers)."""
    generate = (lambda prompts, **kw: sample(model, prompts, **kw)) if isinstance(model, torch.nn.Module) \
        else model.generate
    fmt = chat_format(tok)
    episodes = [Episode(t, tok, enable_thinking=enable_thinking, max_turns=max_turns, judge=judge) for t in tasks]
    try:
        for e in episodes:
            e.reset()
        active = list(range(len(episodes)))
        while active:
            results = []
            for s in range(0, len(active), batch_size):
                chunk = active[s:s + batch_size]
                results += generate([episodes[i].prompt_ids + episodes[i].ids for i in chunk],
                                  max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=set(fmt.stop_ids),
                                  pad_id=fmt.pad_id, generator=generator)
            active = [i for i, (new, lp) in zip(active, results) if not episodes[i].step(new, lp).done]
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
