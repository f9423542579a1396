"""The multi-token prediction (MTP) draft layer a checkpoint carries (GLM-5's own, stored as layer
`num_hidden_layers`, or posttrain's on any model), trained by the megatron engine beside its LM loss (sft and the
ramp) as the torch engine trains it (`posttrain.models.mtp`): the same module, one transformers decoder layer
shared across `depth` draft steps, fed the engine's final hidden states, with the Megatron model's own embedding and
output head, and the same loss.

Why not megatron-core's `MultiTokenPredictionBlock`: it gives each draft step a layer of its own where GLM-5 shares
one across steps, and a Megatron module of our own would have to be held to what the torch engine computes.
transformers' layer is that computation by construction (the tests hold the two engines' losses to 1e-5).

How it splits: the draft layer (its experts too: one layer) sits on the last pipeline stage, replicated on its
ranks, a dense parameter for the engine (its gradient averaged over data-parallel replicas). With context parallelism
each rank runs it over the whole sequence (hidden states gathered), so its gradient is the whole one on every rank
and each keeps 1/cp, as the embedding and head do for it. With pipeline stages the last stage reads the embedding
through its own copy, as Megatron's own MTP does: a tied model's output layer already is one, an untied model's is
broadcast from the first stage (`embedding_copy`), and the two stages sum their gradients before each step, so the
copy moves as the embedding does.

The layer reads the Megatron model through a `Backbone` (its embedding, its head, the config), nothing else of the
engine.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from posttrain.engines.megatron import context_parallel, vocab_parallel
from posttrain.engines.megatron.forward import document_mask
from posttrain.engines.megatron.pipeline_stages import Pipeline
from posttrain.models import mtp
from posttrain.models.moe import count_routes, load_stats, sequence_balance


@dataclass(frozen=True)
class Backbone:
    """What the draft layer reads of the Megatron model it sits on (the last pipeline stage's)."""
    hf_config: Any
    device: torch.device
    vocab_size: int  # the real vocabulary (the head's rows past it pad it to a multiple of tp)
    # this stage's word-embedding weight, its tensor-parallel slice of the vocabulary: the embedding itself on one
    # stage, the last stage's copy of it with pipeline stages (`embedding_copy`; tied: the output layer)
    embedding: Callable[[], torch.Tensor]
    # the head on final hidden states [n, h] of the whole sequence: (this rank's vocabulary slice of the logits, its
    # first token id), the head's gradient a context-parallel share (`context_parallel.shared`)
    logits: Callable[[torch.Tensor], tuple[torch.Tensor, int]]


def calls(steps: int, length: int) -> int:
    """The draft steps (each a call of the layer's router) a draft layer of `steps` runs on rows of `length`."""
    return min(steps, max(0, length - 2))


def _glm5(hf_config) -> bool:
    return mtp.is_glm5(SimpleNamespace(config=hf_config))


def routed(hf_config) -> bool:
    """Whether the draft layer has a router (GLM-5's, a copy of a routed last layer)."""
    types = getattr(hf_config, "mlp_layer_types", None)
    return _glm5(hf_config) and bool(types) and types[-1] == "sparse"


def embedding_copy(gpt, pipe: Pipeline, tied: bool) -> nn.Parameter | None:
    """An untied model's word embedding on the last pipeline stage, broadcast from the first (on the last stage; None
    elsewhere, and with one stage or tied embeddings, whose output layer there is the copy). Every first- and
    last-stage rank calls it."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    if pipe.size == 1 or tied or not ps.is_rank_in_embedding_group():
        return None
    src, group = ps.get_pipeline_model_parallel_first_rank(), ps.get_embedding_group()
    if pipe.first:
        dist.broadcast(gpt.embedding.word_embeddings.weight.data, src=src, group=group)
        return None
    copy = nn.Parameter(torch.empty_like(gpt.output_layer.weight))
    dist.broadcast(copy.data, src=src, group=group)
    copy.shared = True  # counted once in the gradient norm (the first stage's)
    return copy


def sharded_copy(copy: torch.Tensor):
    """The copy in Megatron's distributed checkpoint under the first stage's key, as a replica (Megatron's tied output
    layer on the last stage): it is not written, and loads the embedding."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    from megatron.core.transformer.utils import make_tp_sharded_tensor_for_checkpoint
    replica = (1, 0, ps.get_data_parallel_rank(with_context_parallel=True))
    return make_tp_sharded_tensor_for_checkpoint(copy, "embedding.word_embeddings.weight", replica_id=replica,
                                                 allow_shape_mismatch=True)


def export(draft: Draft | None, pipe: Pipeline) -> dict[str, torch.Tensor]:
    """The draft layer's tensors under transformers' in-memory names (`mtp.`), on every rank (from the last stage)."""
    got = [{f"mtp.{k}": v.detach().cpu().clone() for k, v in draft.module.state_dict().items()} if draft else None]
    if pipe.size > 1:
        dist.broadcast_object_list(got, src=pipe.src, group=pipe.group)
    return got[0]


def pop_stats(draft: Draft | None, pipe: Pipeline) -> dict[str, float]:
    """The step's draft figures (`Draft.pop_stats`) on every pipeline stage, from the last."""
    got = [draft.pop_stats() if draft else None]
    if pipe.size > 1:
        dist.broadcast_object_list(got, src=pipe.src, group=pipe.group)
    return got[0]


def depth(hf_config, checkpoint: str | Path) -> int:
    """The draft steps of the layer `checkpoint` carries (`models.mtp.restore`'s rule); 0: none."""
    settings = getattr(hf_config, mtp.CONFIG_KEY, None)
    if settings:
        return int(settings["depth"])
    if _glm5(hf_config) and getattr(hf_config, "num_nextn_predict_layers", 0) and \
            mtp.glm5_layer(SimpleNamespace(config=hf_config), checkpoint, keys_only=True):
        return 1
    return 0


class _Host(nn.Module):
    """What `models.mtp.MTP` reads of a transformers causal LM: the config, a final norm to copy, the last layer's
    class (on the meta device: the weights come from the checkpoint), RoPE, and the embedding (Megatron's)."""

    def __init__(self, hf_config, embed, device):
        super().__init__()
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_config).base_model
        self.config = hf_config
        self.base_model = nn.Module()
        self.base_model.norm = type(meta.norm)(hf_config.hidden_size, eps=hf_config.rms_norm_eps).to(device)
        self.base_model.rotary_emb = type(meta.rotary_emb)(config=hf_config).to(device)
        self.base_model.layers = nn.ModuleList([meta.layers[-1]])
        self.padding_idx = meta.embed_tokens.padding_idx
        self.__dict__["_embed"] = embed  # Megatron's embedding: not a submodule of this host

    def parameters(self, recurse: bool = True):  # the device and dtype `MTP` takes: the norm's (the layer is meta)
        return self.base_model.norm.parameters(recurse)

    def get_input_embeddings(self):
        return self._embed


class Draft:
    """The draft layer of a megatron engine's checkpoint: `module` (a `models.mtp.MTP`), `loss` over an LM batch,
    `balance` (GLM-5: its router's expert bias, as the torch engine's `RouterHooks` moves it). It sits on `backbone`,
    the last pipeline stage's model."""

    def __init__(self, backbone: Backbone, checkpoint: str | Path, steps: int):
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        self.backbone, self.tp = backbone, ps.get_tensor_model_parallel_world_size()
        self.host = _Host(backbone.hf_config, self._embed, backbone.device)
        self.module = mtp.MTP(self.host, steps)
        got, want = _stored(backbone.hf_config, checkpoint), set(self.module.state_dict())
        if set(got) != want:
            raise ValueError(f"{checkpoint}: config.json names a draft (MTP) layer, but its weights hold "
                             f"{len(set(got) & want)} of its {len(want)} tensors (missing e.g. "
                             f"{sorted(want - set(got))[:3]})")
        self.module.load_state_dict(got)
        cp = context_parallel.size()
        if cp > 1:  # every context-parallel rank computes the whole gradient (the module docstring)
            for p in self.module.parameters():
                p.register_hook(lambda g: g / cp)
        self.router = next((m for n, m in self.module.named_modules() if hasattr(m, "e_score_correction_bias")), None)
        self.load, self._valid, self._rows = None, None, 1
        # the batch being trained (`start`): its targets per draft step, and [MTP loss, first-step hits] summed over
        # its micro-batches; then each batch's (MTP loss, first-step accuracy) until the step's `pop_stats`
        self._targets: list[int] | None = None
        self._batch = [0.0, 0]
        self._seen: list[tuple[float, float | None]] = []
        # (logits, experts) of each router call while `collect_aux` is set: the sequence-wise balance loss's terms
        self.collect_aux, self.aux_terms = False, []
        if self.router is not None:
            self.load = torch.zeros(self.router.e_score_correction_bias.numel())
            self.router.register_forward_hook(self._count)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Megatron's word embeddings of `ids` (vocab-parallel over tp), the weight shared over cp ranks; as
        transformers' embedding, the padding id's row gets no gradient (the draft reads the pad tokens past a row's
        end, and its balance loss would move that row)."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
        pad = self.host.padding_idx
        w = context_parallel.shared(self.backbone.embedding())
        if self.tp == 1:
            return F.embedding(ids, w, padding_idx=pad)
        start = ps.get_tensor_model_parallel_rank() * w.shape[0]  # Megatron's vocabulary split, embedding and head
        end = start + w.shape[0]
        outside = (ids < start) | (ids >= end)
        local = F.embedding((ids - start).masked_fill(outside, 0), w,
                            padding_idx=pad - start if pad is not None and start <= pad < end else None)
        return reduce_from_tensor_model_parallel_region(local.masked_fill(outside[..., None], 0))

    def _count(self, router, args, out) -> None:
        if torch.is_grad_enabled():
            self.load = count_routes(self.load, out[2], self._valid)
            if self.collect_aux:
                self.aux_terms.append((out[0], out[2], self._valid, self._rows))

    def calls(self, length: int) -> int:
        """The draft steps (each a call of its router) `loss` runs on rows of `length` tokens."""
        return calls(self.module.depth, length)

    @staticmethod
    def _trained(ids: torch.Tensor, lmask: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
        """[b, T]: where draft step k trains (token i + k + 1 is a target of the loss mask, in token i's document)."""
        tmask = F.pad(lmask[:, k + 1:], (0, k + 1)) != 0
        return tmask & (F.pad(pos[:, k + 1:] - pos[:, :-k - 1], (0, k + 1)) == k + 1)

    @staticmethod
    def _positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, pos = batch["input_ids"], batch.get("position_ids")
        return pos if pos is not None else torch.arange(ids.shape[1], device=ids.device).expand(*ids.shape)

    def start(self, batch: dict[str, torch.Tensor]) -> None:
        """The next forwards are `batch`'s micro-batches (the engine's 1F1B split): each step's mean is over the whole
        batch's targets, as the torch engine's one forward of it has it."""
        ids, pos = batch["input_ids"], self._positions(batch)
        self._targets = [int(self._trained(ids, batch["loss_mask"], pos, k).sum())
                         for k in range(1, self.calls(ids.shape[1]) + 1)]
        self._batch = [0.0, 0]

    def _first(self) -> int:
        """The first draft step with a target in the batch (its accuracy is logged, as the torch engine's); 0: none."""
        return next((k for k, n in enumerate(self._targets, 1) if n), 0)

    def finish(self) -> None:
        """The batch's MTP loss and first-step accuracy, for the step's figures."""
        if self._targets is not None:
            first = self._first()
            self._seen.append((self._batch[0], self._batch[1] / self._targets[first - 1] if first else None))
        self._targets = None

    def loss(self, h: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | int]:
        """`models.mtp.loss` on the engine's final hidden states `h` [b, T, h] (the whole sequence) of a micro-batch
        of the batch `start` announced: the mean over draft steps of the cross-entropy of token i + k + 1 where the
        loss mask trains it, in token i's document (its share of the batch's); and the first step's top-1 hits."""
        m, vocab = self.module, self.backbone.vocab_size
        ids, lmask, pos = batch["input_ids"], batch["loss_mask"], self._positions(batch)
        B, T = ids.shape
        allowed = ~document_mask(pos, batch.get("attention_mask"))  # [b, 1, T, T]: True may attend
        mask = batch.get("attention_mask")
        self._valid, self._rows = None if mask is None else mask.reshape(-1).bool(), B
        totals, first_step = self._targets, self._first()
        state, losses, hits = h, [], 0
        for k in range(1, self.calls(T) + 1):
            nxt, target = F.pad(ids[:, k:], (0, k)), F.pad(ids[:, k + 1:], (0, k + 1))
            tmask = self._trained(ids, lmask, pos, k)
            state = m.step(self.host, state, nxt, pos, allowed)
            if not tmask.any():
                continue
            logits, first = self.backbone.logits(m.norm_out(state[tmask]))
            logp, _ = vocab_parallel.token_scores(logits, first, vocab, 1.0, target=target[tmask], entropy=False)
            losses.append(-logp.sum() / totals[k - 1])
            if k == first_step:
                hits = _top1(logits, first, target[tmask], vocab)
        self._valid = None
        steps = sum(1 for n in totals if n)  # the batch's steps with a target
        return (torch.stack(losses).sum() / steps if losses else h.sum() * 0.0), hits

    def train_loss(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor], weight: float, aux,
                   aux_weight: float) -> torch.Tensor:
        """`loss` on this rank's final hidden states [b, s, h] times `weight`, and its router's terms of the balance
        loss (`aux`, `glm5.SeqAux`, while it has a weight), as gradients only: the value 0, so the LM loss
        stays comparable with a run without them (as `models.mtp.with_loss` and `models.moe.with_aux_loss` have it)."""
        if context_parallel.size() > 1:  # the layer attends over the whole sequence
            hidden = context_parallel.GatherOutput.apply(hidden.transpose(0, 1).contiguous()).transpose(0, 1)
        aux = aux if aux is not None and aux.weight else None
        self.collect_aux = aux is not None
        whole = self._targets is None  # a forward of its own: its batch is this one
        if whole:
            self.start(batch)
        try:
            draft, hits = self.loss(hidden[:, :batch["input_ids"].shape[1]], batch)
        finally:
            self.collect_aux = False
        self._batch[0] += draft.detach()  # tensors until the step's figures: no host sync per micro-batch
        self._batch[1] += hits
        if whole:
            self.finish()
        out = weight * (draft - draft.detach())
        terms, self.aux_terms = self.aux_terms, []
        if aux is not None and terms:  # the whole value on every context-parallel rank: a share of it counted
            balance = sum(sequence_balance(*t)[0] for t in terms) / (aux.routers * aux.rows)
            aux.values.append(balance.detach() / context_parallel.size())
            out = out + aux_weight * (balance - balance.detach())
        return out

    def pop_stats(self) -> dict[str, float]:
        """The step's mean MTP loss and first-step accuracy (the torch engine logs each forward's); {} without one."""
        seen, self._seen = self._seen, []
        accs = [a for _, a in seen if a is not None]
        return ({"mtp_loss": float(sum(x for x, _ in seen)) / len(seen)} if seen else {}) | (
            {"mtp_acc1": float(sum(accs)) / len(accs)} if accs else {})

    def balance(self, rate: float) -> dict[str, float] | None:
        """After an optimizer step: its router's load over every replica's tokens (load_stats), the bias moved `rate`
        toward uniform load; None when it routed nothing (a dense draft layer, or a step without its loss)."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        if self.router is None:
            return None
        load, self.load = self.load, torch.zeros_like(self.load)
        if dist.get_world_size(group := ps.get_data_parallel_group()) > 1:  # not over cp: each rank saw every token
            load = load.to(self.backbone.device)
            dist.all_reduce(load, group=group)
        load = load.cpu()
        if not float(load.sum()):
            return None
        with torch.no_grad():
            b = self.router.e_score_correction_bias
            b += (rate * torch.sign(load.mean() - load)).to(b.device, b.dtype)
        return load_stats(load)

    def sharded_state_dict(self, prefix: str) -> dict:
        """For Megatron's distributed checkpoint: the layer replicated over every rank, under `prefix`."""
        # megatron-core only after layout.cpu_patches (layout.py)
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        return make_sharded_tensors_for_checkpoint(self.module.state_dict(keep_vars=True), prefix)


def _top1(logits: torch.Tensor, first: int, target: torch.Tensor, vocab: int) -> torch.Tensor:
    """How many of `target` are the argmax of the (vocab-parallel) logits."""
    from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
    z = logits.detach().float()
    if first + z.shape[-1] > vocab:  # the padding to a multiple of tp is never the answer
        z[:, vocab - first:] = float("-inf")
    top = z.max(-1).values
    local = target - first
    here = (local >= 0) & (local < z.shape[-1])
    picked = torch.where(here, z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1),
                         torch.full_like(top, float("-inf")))
    if ps.get_tensor_model_parallel_world_size() > 1:
        group = ps.get_tensor_model_parallel_group()
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        dist.all_reduce(picked, dist.ReduceOp.MAX, group=group)
    return (picked >= top).sum()


def _stored(hf_config, checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The draft layer's weights as `checkpoint` holds them (GLM-5's layer num_hidden_layers, or posttrain's `mtp.`
    tensors) under the module's own names."""
    if _glm5(hf_config):
        got = mtp.glm5_layer_state(SimpleNamespace(config=hf_config), checkpoint)
    else:
        got = {}
        for f in sorted(Path(checkpoint).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                got |= {k: st.get_tensor(k) for k in st.keys() if k.startswith("mtp.")}
    return {k.removeprefix("mtp."): v for k, v in got.items() if k.startswith("mtp.")}
