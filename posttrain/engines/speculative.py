"""Speculative decoding with the model's own MTP layer (posttrain.models.mtp): draft `depth` tokens, check them in one
forward of the model, keep what the model itself would have produced.

Greedy: a draft is kept while it equals the model's argmax, and the model's own next token follows, so the
output is plain greedy decoding's. Sampling: speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
draft d ~ q is kept with probability min(1, p(d) / q(d)), else one token is drawn from max(0, p - q) and the
rest of the draft dropped; every emitted token then follows p exactly, so RL's behaviour log-probabilities (p's
own, returned per token) stay token in, token out.

The batch decodes together: every row feeds `depth + 1` slots to the model per verification and rejected slots
stay in the KV cache with their attention mask set to 0 (positions count valid slots only), so rows that keep
different numbers of tokens never need their caches cut to different lengths. The MTP layer keeps its own cache
the same way: one slot per position (the model's hidden state there and the next token), rebuilt for the
positions a verification accepted, plus the draft steps' slots, dropped after each verification.
"""
from __future__ import annotations

import torch

from posttrain.engines.base import Generation
from posttrain.engines.sampling import exponential_noise, gumbel_draw, on_device
from posttrain.models import mtp as mtp_module
from posttrain.models.kv_cache import decode_cache
from posttrain.models.prefix import prefill_distinct


def verify(logp: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, temperature: float,
           generator: torch.Generator | None = None, noise: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """How many drafts each row keeps, and the token that follows them.

    logp: the model's log-probabilities [B, n + 1, V] at the positions predicting draft 1..n and the one after;
    q: the draft probabilities [B, n, V] (unused by greedy); drafts [B, n]. Greedy when `temperature` is 0.
    `noise`: Exp(1) noise [B, V + n] (the residual draw's, then the acceptance tests'), drawn from `generator`
    when not given."""
    B, n = drafts.shape
    if temperature <= 0:
        best = logp.argmax(-1)
        kept = (drafts == best[:, :n]).long().cumprod(1).sum(1)
        return kept, best.gather(1, kept[:, None]).squeeze(1)
    V = logp.shape[-1]
    if noise is None:
        noise = exponential_noise((B, V + n), on_device(generator, logp.device), logp.device)
    p = logp.exp()
    pd, qd = p[:, :n].gather(2, drafts[..., None]).squeeze(2), q.gather(2, drafts[..., None]).squeeze(2)
    u = torch.exp(-noise[:, V:])                           # uniform on (0, 1]
    kept = (u * qd < pd).long().cumprod(1).sum(1)
    rows = torch.arange(B, device=p.device)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, kept]    # no draft after the last: q = 0
    residual = (p[rows, kept] - q_next).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, kept])
    return kept, gumbel_draw(residual.log(), generator, noise[:, :V])


def _mask(valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """[B, 1, q_len, S] boolean mask for the last `q_len` of S slots: valid keys at or before the query's slot,
    and always the query itself (a padding query then attends to something)."""
    S = valid.shape[1]
    slots = torch.arange(S, device=valid.device)
    q_slots = slots[S - q_len:]
    allowed = valid.bool()[:, None, :] & (slots[None, :] <= q_slots[:, None])[None]
    allowed |= (slots[None, :] == q_slots[:, None])[None]
    return allowed[:, None]


@torch.no_grad()
def sample_speculative(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                       stop_ids: set[int], pad_id: int, generator: torch.Generator | None = None,
                       stats: dict | None = None) -> list[Generation]:
    """`posttrain.engines.torch_rollout.sample`, drafting with the model's MTP layer. `stats` gains
    `verifications` (row-forwards of the model after the first token) and `accepted` (tokens they produced)."""
    mtp = mtp_module.get(model)
    n, base, head = mtp.depth, model.base_model, model.get_output_embeddings()
    # rejected drafts keep their slots: the caches grow by n + 1 per verification (doubling when outgrown)
    reserve = max(map(len, prompts)) + 2 * max_new_tokens + n + 1
    out, cache, attn, which = prefill_distinct(base, prompts, pad_id, decode_cache(reserve, base))
    h = out.last_hidden_state[which]
    dev = h.device
    generator = on_device(generator, dev)
    L = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts], device=dev)

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, log-probability under the model at the temperature) for [B, V] logits."""
        logp = torch.log_softmax(logits.float() / temperature if temperature > 0 else logits.float(), -1)
        tok = gumbel_draw(logp, generator) if temperature > 0 else logits.argmax(-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)

    def draft(logits: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(draft token, the draft distribution q it came from; None for greedy, whose check needs no q)."""
        if temperature <= 0:
            return logits.argmax(-1), None
        logq = torch.log_softmax(logits.float() / temperature, -1)
        return gumbel_draw(logq, generator, noise), logq.exp()

    x, x_lp = pick(head(h[:, -1]))
    out_ids, out_lp = [[t] for t in x.tolist()], [[v] for v in x_lp.tolist()]
    stopped = [t in stop_ids for t in x.tolist()]
    rows = list(range(len(prompts)))                       # batch row -> prompt index, on the host
    pos = attn.sum(-1)                                     # where each row's next token goes
    # the MTP layer over the prompt: slot j holds (hidden state at j, token j + 1)
    dcache, dattn = decode_cache(reserve, base), attn.clone()
    g = mtp.step(model, h, torch.cat([ids[:, 1:], x[:, None]], 1), (attn.cumsum(-1) - 1).clamp(min=0),
                 _mask(dattn, L), dcache)[:, -1:]
    lg = mtp.logits(model, g[:, 0])
    ar, V = torch.arange(n + 1, device=dev), lg.shape[-1]
    while True:
        live = [i for i, r in enumerate(rows) if not stopped[r] and len(out_ids[r]) < max_new_tokens]
        if not live:
            break
        if len(live) < len(rows):
            keep = torch.tensor(live, dtype=torch.long, device=dev)
            cache.batch_select_indices(keep)
            dcache.batch_select_indices(keep)
            rows = [rows[i] for i in live]
            attn, dattn, x, pos, g, lg = attn[keep], dattn[keep], x[keep], pos[keep], g[keep], lg[keep]
        # a verification's randomness in one draw: each draft step's noise, then verify's
        noise = exponential_noise((len(rows), (n + 1) * V + n), generator, dev) if temperature > 0 else None
        # draft n tokens: step 1 came from the last catch-up; steps 2..n extend the MTP layer's cache
        tok, probs = draft(lg, None if noise is None else noise[:, :V])
        drafts, q = [tok], [probs]
        for s in range(1, n):
            dattn = torch.cat([dattn, torch.ones_like(dattn[:, :1])], 1)
            g = mtp.step(model, g, drafts[-1][:, None], (pos - 1 + s)[:, None], _mask(dattn, 1), dcache)
            lg = mtp.logits(model, g[:, 0])
            tok, probs = draft(lg, None if noise is None else noise[:, s * V:(s + 1) * V])
            drafts.append(tok)
            q.append(probs)
        d = torch.stack(drafts, 1)
        # verify: the model on [x, d1..dn] in one forward
        attn = torch.cat([attn, torch.ones_like(attn[:, :n + 1])], 1)
        hid = base(input_ids=torch.cat([x[:, None], d], 1), attention_mask=attn, position_ids=pos[:, None] + ar,
                   past_key_values=cache, use_cache=True).last_hidden_state
        logits = head(hid).float()
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
        kept, y = verify(logp, torch.stack(q, 1) if temperature > 0 else None, d, temperature, generator,
                         None if noise is None else noise[:, n * V:])
        new = torch.cat([d, y[:, None]], 1).scatter(1, kept[:, None], y[:, None])   # d1..d_kept, y
        new_lp = logp.gather(2, new[..., None]).squeeze(2)
        valid = (ar[None] <= kept[:, None]).long()         # x and the kept drafts stay in the model's cache
        attn[:, -(n + 1):] = valid
        if n > 1:
            dattn[:, -(n - 1):] = 0                        # the draft steps' slots
        # catch up the MTP layer on the accepted positions: slot j = (hidden state at pos + j, token pos + j + 1)
        dattn = torch.cat([dattn, valid], 1)
        g = mtp.step(model, hid, new, pos[:, None] + ar, _mask(dattn, n + 1), dcache)
        g = g.gather(1, kept[:, None, None].expand(-1, 1, g.shape[-1]))   # the head runs at the kept slot only
        lg = mtp.logits(model, g[:, 0])
        x, pos = y, pos + kept + 1
        # the host reads the verification once, after the catch-up is queued (on a GPU a read waits for it all)
        got, got_lp = torch.cat([kept[:, None], new], 1).tolist(), new_lp.tolist()
        for r, (k, *toks), lps in zip(rows, got, got_lp):
            for t, v in zip(toks[:k + 1], lps[:k + 1]):
                if stopped[r] or len(out_ids[r]) >= max_new_tokens:
                    break
                out_ids[r].append(t)
                out_lp[r].append(v)
                stopped[r] = t in stop_ids
        if stats is not None:
            stats["verifications"] = stats.get("verifications", 0) + len(rows)
            stats["accepted"] = stats.get("accepted", 0) + sum(k + 1 for k, *_ in got)
    return [Generation(i, lp, "stop" if s else "length") for i, lp, s in zip(out_ids, out_lp, stopped)]
