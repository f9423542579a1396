"""The local rollout engine: batched sampling with a KV cache in plain torch (CPU or one GPU)."""
from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from posttrain.chat import chat_format
from posttrain.device import device
from posttrain.engines.base import Generation, WeightSource
from posttrain.engines.sampling import gumbel_draw, on_device
from posttrain.engines.speculative import sample_speculative
from posttrain.models import mtp
from posttrain.models.attention import fast_decoding, padding_free
from posttrain.models.kv_cache import decode_cache
from posttrain.models.moe import RouterHooks
from posttrain.models.prefix import micro_batches, prefill_distinct, prefix_forward
from posttrain.models.preset import load_checkpoint
from posttrain.quant.int_linear import is_compressed, load_any
from posttrain.quant.rollout import w4a8_copy
from posttrain.routing_replay import RolloutRoutes


@torch.no_grad()
def sample(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, stop_ids: set[int],
           pad_id: int, generator: torch.Generator | None = None, routes=None) -> list[Generation]:
    """Generate for a batch of token-id prompts; temperature 0 is greedy. `routes`: a
    posttrain.models.moe.RouterHooks on the model, to record each row's experts (`Generation.routes`,
    posttrain.routing_replay).

    Identical prompts (a GRPO group) are prefilled once and share their KV cache; finished rows leave
    the batch once an eighth of it has finished, so the cost follows the unfinished rows."""
    reserve = max(map(len, prompts)) + max_new_tokens
    if routes is not None:
        routes.record()
    out, cache, attn, which = prefill_distinct(model, prompts, pad_id, decode_cache(reserve, model))
    log = RolloutRoutes(routes.take_forward(), prompts, which) if routes is not None else None
    logits = out.logits[:, -1].float()[which]
    dev = logits.device
    generator = on_device(generator, dev)
    rows = list(range(len(prompts)))                                  # batch row -> prompt index, on the host
    live = torch.ones(len(prompts), dtype=torch.bool, device=dev)
    out_ids, out_lp = [[] for _ in prompts], [[] for _ in prompts]
    stopped = [False] * len(prompts)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
        nxt = gumbel_draw(logp, generator) if temperature > 0 else logits.argmax(-1)
        lp = logp.gather(1, nxt[:, None]).squeeze(1)
        hit = torch.isin(nxt, stop)
        # one transfer to the host per token: on a GPU each one waits for the step's kernels
        toks, lps = torch.stack([nxt, hit.long()]).tolist(), lp.tolist()
        for i, r in enumerate(rows):
            if not stopped[r]:
                out_ids[r].append(toks[0][i])
                out_lp[r].append(lps[i])
                stopped[r] = bool(toks[1][i])
        live &= ~hit
        alive = [i for i, r in enumerate(rows) if not stopped[r]]
        if not alive or t == max_new_tokens - 1:
            break
        if (len(rows) - len(alive)) * 8 >= len(rows):
            keep = torch.tensor(alive, device=dev)
            cache.batch_select_indices(keep)
            attn, nxt, live = attn[keep], nxt[keep], live[keep]
            rows = [rows[i] for i in alive]
        attn = torch.cat([attn, live.long()[:, None]], 1)
        logits = model(input_ids=torch.where(live, nxt, pad_id)[:, None], attention_mask=attn,
                       position_ids=(attn.sum(-1) - 1)[:, None], past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
        if log is not None:
            log.step(routes.take_forward(), rows, stopped)
    if routes is not None:
        routes.take_recorded()
    return [Generation(i, lp, "stop" if s else "length", log.row(r) if log is not None else None)
            for r, (i, lp, s) in enumerate(zip(out_ids, out_lp, stopped))]


class TorchRolloutEngine:
    """A causal LM in this process. `model` is shared, not copied: an engine over the trainer's own policy
    (validation) sees its updates at once; workers and teachers hold their own copy (`from_checkpoint`)."""

    def __init__(self, model: torch.nn.Module, tokenizer, max_cells: int = 4096, w4a8: bool = False,
                 owns_model: bool = False):
        # w4a8: generate from a W4A8 copy of `model` (posttrain.quant.rollout), made again at each weight update;
        # owns_model: no one else runs `model` (`from_checkpoint`), so scoring may switch its attention (`score`)
        self.master = model if w4a8 else None
        self.owns_model = owns_model
        self.model, self.tokenizer = self._serving(model), tokenizer
        self.pad_id, self.max_cells = chat_format(tokenizer).pad_id, max_cells
        self.version = 0
        # decode with the model's MTP layer as the draft when it has one (posttrain.models.mtp); `stats` counts
        # its verifications and the tokens they produced (acceptance length = accepted / verifications)
        self.speculative, self.stats = True, {}
        self.routes = None  # record_routes(): the experts of every generated row (routing replay)
        self._open = threading.Event()
        self._open.set()

    def _serving(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.master is not None:
            model = w4a8_copy(model)
        fast_decoding(model)
        return model.eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: str = "float32") -> "TorchRolloutEngine":
        """`dtype`: what the weights, activations and KV cache are held in (the sampling distribution is fp32);
        `w4a8`: the quantize stage's integer scheme, rounded to nearest (posttrain.quant.rollout). The checkpoint is
        plain or W4A8 compressed-tensors (posttrain.quant.int_linear)."""
        if dtype == "w4a8" and is_compressed(path):
            raise ValueError(f"rollout dtype w4a8: {path} is a W4A8 export already; give its unquantized checkpoint")
        model, tok = load_any(path)
        if dtype == "w4a8":
            return cls(model.to(device()), tok, w4a8=True, owns_model=True)
        return cls(model.to(device(), getattr(torch, dtype)), tok, owns_model=True)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, stop_ids: set[int],
                 generator: torch.Generator | None = None) -> list[Generation]:
        self._open.wait()
        if self.speculative and self.routes is None and mtp.get(self.model) is not None:
            return sample_speculative(self.model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                      stop_ids=stop_ids, pad_id=self.pad_id, generator=generator, stats=self.stats)
        return sample(self.model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                      stop_ids=stop_ids, pad_id=self.pad_id, generator=generator, routes=self.routes)

    def record_routes(self) -> None:
        """From now on every Generation carries the experts each of its tokens went through (routing replay);
        decoding is plain then, without the MTP draft. A model without routers is refused. (Not part of the
        RolloutEngine protocol: the engines that declare ROUTING_RECORD in posttrain.engines.registry have it.)"""
        hooks = RouterHooks(self.model)
        if not hooks.routers:
            raise ValueError(f"routing replay: {type(self.model).__name__} has no mixture-of-experts router to record")
        self.routes = hooks

    @torch.no_grad()
    def score(self, items: list[tuple[list[int], list[int], list[int]]], *, mode: str = "sampled", top_k: int = 16,
              temperature: float = 1.0) -> list:
        """The teacher's distribution over each generated token, at the student's sampling temperature. A model the
        engine owns scores the samples as one row without padding where it can (posttrain.models.attention
        .padding_free: what a teacher and the guard's judge do with their engines)."""
        if self.owns_model:
            padding_free(self.model)
        samples = [SimpleNamespace(prompt_ids=p, ids=ids) for p, ids, _ in items]
        out: list = [None] * len(items)
        for idx in micro_batches(samples, self.max_cells):  # bounded memory for the [rows, T, V] logits
            logits = prefix_forward(self.model, [samples[i] for i in idx], self.pad_id).float()
            logp = torch.log_softmax(logits / temperature, -1)
            for row, i in enumerate(idx):
                _, ids, mask = items[i]
                pos = torch.tensor([j for j, m in enumerate(mask) if m], dtype=torch.long)
                lp = logp[row, pos]
                if mode == "sampled":
                    out[i] = lp.gather(-1, torch.tensor(ids, device=lp.device)[pos, None]).squeeze(-1).tolist()
                elif mode == "topk":
                    v, k = lp.topk(min(top_k, lp.size(-1)), -1)
                    out[i] = (k.to(torch.int32).cpu().numpy(), v.cpu().numpy())
                else:
                    out[i] = lp.cpu().numpy().astype(np.float32)
        return out

    def update_weights(self, source: WeightSource, version: int) -> None:
        if isinstance(source, (str, Path)):  # weights by disk: a checkpoint folder
            source = load_checkpoint(source)[0].state_dict()
        self.pause()
        try:
            if self.master is None:
                self.model.load_state_dict(source)
            else:  # quantized again from the new weights
                self.master.load_state_dict(source)
                self.model = self._serving(self.master)
                if self.routes is not None:
                    self.record_routes()
            self.version = version
        finally:
            self.resume()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Nothing outlives garbage collection here: the model is in this process."""
