"""The Megatron-core train engine: the policy, the PPO critic or the KL reference as a megatron-core GPTModel split
over ranks (tensor parallel, optionally sequence parallel; context parallel; pipeline stages,
`engines.pipeline_stages`; data parallel over the remaining ranks), loaded from and exported to Hugging Face tensors
through mbridge (`engines.megatron_setup`).

Each rank holds one `MegatronTrainEngine` and runs every call in step with the others (SPMD): torch.distributed over
gloo on CPU, NCCL on CUDA. One process without a launcher is a world of one rank.

Scoring is vocab-parallel (`engines.vocab_parallel`): each tensor-parallel rank holds a slice of the output
embeddings and scores its slice of the vocabulary. Rows are each sample's prompt and completion, right-padded, under a
causal mask; the head runs only at the positions that predict a completion token.

Gradients: the data-parallel ranks' gradients are averaged with one all-reduce per step; with sequence parallelism
the norms' gradients (computed on each rank's slice of the sequence) are summed over the tensor-parallel group, as
Megatron's DDP does. The optimizer is torch's fused AdamW on each rank's own parameters (the torch engine's), or with
`distributed_optimizer` on the share of them this rank owns (`engines.zero_optimizer`); the clipping norm counts
tensor-parallel shards once each. Megatron's own DDP and distributed optimizer hard-code CUDA devices and streams, so
they are not used here.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.engines import (context_parallel, megatron_dsa, megatron_glm5, megatron_mtp, vocab_parallel,
                               zero_optimizer)
from posttrain.engines.base import one_by_one
from posttrain.engines.megatron_setup import (Parallel, bridge, check_layout, init_parallel, local_spec, quiet,
                                              recompute_layers)
from posttrain.engines.pipeline_stages import Pipeline, StageDone, one_f_one_b, staged

# Rows longer than this attend per document (`context_parallel.document_attention`, Megatron's local layers) instead of
# through one [T, T] mask: at 2k tokens a mask is 4 MB a row, at 128k 16 GB, and on CUDA a mask keeps SDPA off its
# flash kernel. Transformer Engine's layers (cp 1 where it is installed) still take the mask.
DENSE_MASK_MAX = 2048
DRAFT = "draft."  # the draft (MTP) layer's keys in the distributed checkpoint
DRAFT_EMBEDDING = "draft_embedding"  # the last stage's copy of an untied embedding (its key: the first stage's)


def _without_rng(common: dict) -> dict:
    """The common part of a distributed checkpoint as Megatron compares it over ranks before saving rank 0's: without
    the RNG states, which data-parallel ranks draw from on their own (rank 0's are saved; dropout is off, so the
    model's forward draws nothing)."""
    return {**common, "common": {k: v for k, v in common["common"].items() if k not in ("rng", "python_rng")}}


class MegatronTrainEngine:
    """A checkpoint as a Megatron GPTModel on this rank: `policy` (AdamW at `lr`), `critic` (a zero-initialised value
    head on the backbone's last hidden state) or `reference` (forward only)."""

    def __init__(self, checkpoint: str | Path, role: str = "policy", *, lr: float | None = None,
                 parallel: Parallel = Parallel(), weight_decay: float = 0.0, seed: int = 0, recompute: bool = False,
                 moe=None, routing_replay: bool = False, distributed_optimizer: bool = False, micro_batches: int = 1,
                 train_indexers: tuple[str, int, float] | None = None, mtp_weight: float = 0.0):
        from transformers import AutoConfig, AutoTokenizer

        from posttrain.chat import pad_id
        from posttrain.device import device as default_device
        from posttrain.models.preset import check_folder
        check_folder(checkpoint)
        hf_config = AutoConfig.from_pretrained(checkpoint)
        try:
            check_layout(hf_config, parallel)
            if hf_config.model_type in megatron_glm5.MODEL_TYPES:
                megatron_dsa.check(hf_config, parallel, recompute)
        except ValueError as e:
            raise ValueError(f"{Path(checkpoint) / 'config.json'}: {e}") from None
        init_parallel(parallel, seed)
        self.parallel, self.role, self.checkpoint = parallel, role, str(checkpoint)
        self.micro_batches = micro_batches
        self.device = default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.pad_id = pad_id(self.tokenizer)
        self.pipe = Pipeline()
        with quiet():
            self.bridge = bridge(hf_config, parallel, recompute=recompute)
            self.gpt = self.bridge._model_provider([])(pre_process=self.pipe.first,
                                                       post_process=self.pipe.last).to(self.device)
            self.bridge.load_weights([self.gpt], str(checkpoint))
        self.hf_config = hf_config
        self.glm5 = hf_config.model_type in megatron_glm5.MODEL_TYPES
        self._passthrough, self._sparse, self._dsa = {}, False, None
        self._draft_depth = megatron_mtp.depth(hf_config, checkpoint)
        if self.glm5:
            megatron_glm5.finish(self.gpt)
            self._sparse = megatron_glm5.sparse_layers(self.gpt)
            self._passthrough = megatron_glm5.passthrough(checkpoint, hf_config, indexers=not self._sparse)
        if train_indexers:  # (mode, kl_queries, kl_weight): the ramp's DSA adoption
            if not self._sparse:
                raise ValueError(f"ramp.attention dsa: {checkpoint} has no DSA indexer this engine runs (a GLM-5 "
                                 f"checkpoint on Megatron's local layers); use runtime.train_engine torch")
            self._dsa = megatron_dsa.train_indexers(self.gpt, hf_config, *train_indexers[:2])
            self._kl_weight = train_indexers[2]
        self.indexer_stats: dict[str, float] = {}
        if recompute and not torch.cuda.is_available():
            recompute_layers(self.gpt)
        self.vocab_size = hf_config.vocab_size
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        modules = {"gpt": self.gpt}
        # the checkpoint's draft layer, on the last pipeline stage, trained by sft's and the ramp's LM loss at
        # `mtp_weight`; an untied embedding's copy there (`megatron_mtp.embedding_copy`); `mtp_stats`: the last step's
        # MTP loss and first-step accuracy
        self.draft, self._mtp_weight, self.mtp_stats = None, mtp_weight, {}
        self._draft_copy = megatron_mtp.embedding_copy(self) if self._draft_depth else None
        if self._draft_copy is not None:
            modules["draft_embedding"] = torch.nn.ParameterDict({"weight": self._draft_copy})
        if self._draft_depth and self.pipe.last:
            self.draft = megatron_mtp.Draft(self, checkpoint, self._draft_depth)
            modules["mtp"] = self.draft.module
        if role == "critic":
            self.value_head = torch.nn.Linear(hf_config.hidden_size, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)  # predicts 0 everywhere at first, as the torch critic
            torch.nn.init.zeros_(self.value_head.bias)
            modules["value_head"] = self.value_head
        self.model = torch.nn.ModuleDict(modules)
        self.opt = self.sched = self.shards = None
        if lr is not None and role != "reference":
            from posttrain.train import make_optimizer
            if distributed_optimizer:
                self.shards = self._shards()
            trained = [p for p in self.model.parameters() if p.requires_grad]  # not GLM-5's frozen indexers
            self.opt = make_optimizer(self.shards.mine if self.shards else trained, lr, weight_decay)
        else:
            self.model.requires_grad_(False)
        # `routers` is the torch engine's hook object (aux loss, replay): Megatron's MoE layers route themselves here
        self.routers, self.moe_stats, self._hf = None, {}, None
        from posttrain.config import MoEConfig
        self.moe = moe or MoEConfig()
        self._balance = self.glm5 and moe is not None and self.opt is not None
        # DeepSeek-V3's sequence-wise balance loss beside sft's and the ramp's LM loss (`megatron_glm5.SeqAux`)
        self._aux = megatron_glm5.SeqAux(megatron_glm5.n_routers(hf_config)) \
            if self._balance and self.moe.aux_loss_weight else None
        if self._aux is not None:
            for _, router in megatron_glm5.moe_layers(self.gpt, hf_config):
                router.seq_aux = self._aux
        if routing_replay and not self.glm5:
            raise ValueError(f"rl.routing_replay: needs a mixture-of-experts policy; {checkpoint} is a dense "
                             f"{hf_config.model_type}")
        if routing_replay and recompute:  # a recomputed forward would route by itself
            raise ValueError("rl.routing_replay: not with megatron.recompute (the recomputed forward would not "
                             "replay the routes)")
        self.routing_replay, self._targets = routing_replay, None  # the rollout's routes for the next forward
        self.eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, role: str = "policy", *, lr: float | None = None, moe=None,
                        routing_replay: bool = False, parallel: Parallel = Parallel(),
                        recompute: bool = False, distributed_optimizer: bool = False,
                        micro_batches: int = 1) -> "MegatronTrainEngine":
        return cls(path, role, lr=lr, parallel=parallel, recompute=recompute, moe=moe, routing_replay=routing_replay,
                   distributed_optimizer=distributed_optimizer, micro_batches=micro_batches)

    def _shards(self) -> zero_optimizer.Shards:
        """The distributed optimizer's split: the dense parameters over the data-parallel (and context-parallel)
        ranks, which hold them alike; a MoE model's experts over their own replicas (expert data parallel)."""
        from megatron.core import parallel_state as ps
        params = [p for p in self.model.parameters() if p.requires_grad]
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        return zero_optimizer.Shards([(dense, ps.get_data_parallel_group(with_context_parallel=True)),
                                      (experts, ps.get_expert_data_parallel_group() if experts else None)])

    # --- the forward in the completion layout -----------------------------------------------------------------
    def _rows(self, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded rows of prompt + completion, and (row, position) of each position that predicts a
        completion token, in sample order then token order."""
        rows = [list(s.prompt_ids) + list(s.ids) for s in samples]
        T = max(map(len, rows))
        ids = torch.tensor([r + [self.pad_id] * (T - len(r)) for r in rows], device=self.device)
        row = torch.tensor([i for i, s in enumerate(samples) for _ in s.ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([len(s.prompt_ids) - 1 + j for s in samples for j in range(len(s.ids))],
                           dtype=torch.long, device=self.device)
        return ids, row, pos

    def _hidden(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, local: bool = False, padding: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The decoder's last hidden state (after the final norm) [b, T, h], the full sequence on every rank.
        Without `position_ids` each row is one sequence; with them each restart at 0 begins a new document that
        attends only to itself (packed rows: Megatron's block-diagonal mask, since its packed-sequence kernels need
        Transformer Engine); `attention_mask` (1 = token, 0 = padding) keeps padding out.
        `local`: (this context-parallel rank's hidden states [b, s, h], their sequence positions [s]) instead; with
        one context-parallel rank that is the whole sequence. `padding` [b, T] (True: padding) keeps padding out of
        the experts' load (`attention_mask`'s zeros when not given)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        b, T = ids.shape
        if self.glm5:
            megatron_glm5.check_rows(self.hf_config, int(position_ids.max()) + 1 if position_ids is not None else T,
                                     self.checkpoint, self._sparse)
            if padding is None and attention_mask is not None:
                padding = attention_mask == 0
        cp = context_parallel.size()
        if self._dsa is not None:  # the indexer loss samples its queries over the rows' own length
            self._dsa.length = T
        causal = position_ids is None and attention_mask is None  # one sequence a row: no mask to build
        if position_ids is None:
            position_ids = torch.arange(T, device=ids.device)[None].expand(b, T)
        # sequence parallelism splits the sequence over tp, context parallelism into 2 x cp chunks
        pad = (-T) % ((self.parallel.tp if self.parallel.sequence_parallel else 1) * (2 * cp if cp > 1 else 1))
        if pad:
            ids, position_ids = F.pad(ids, (0, pad), value=self.pad_id), F.pad(position_ids, (0, pad))
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad))
            if padding is not None or self.glm5:  # the tail added for the chunks is no token the experts count
                padding = F.pad(padding if padding is not None else torch.zeros_like(ids[:, :T], dtype=torch.bool),
                                (0, pad), value=True)
        targets = self._targets
        if targets is not None and pad:
            targets = F.pad(targets, (0, 0, 0, pad), value=-1)
        if T + pad > DENSE_MASK_MAX and (cp > 1 or not causal) and local_spec(self.parallel):  # per document
            mask = self._segments(position_ids, attention_mask)
            mask[:, T:] = -1
        else:
            mask = None if causal else self._document_mask(position_ids, attention_mask)
        where = torch.arange(T + pad, device=ids.device)
        if cp > 1:  # this rank's chunks of every row; attention sees the whole sequence's keys (context_parallel)
            where = context_parallel.positions(T + pad, cp, ps.get_context_parallel_rank(), ids.device)
            if mask is None or mask.dtype == torch.bool:
                mask = context_parallel.local_mask(mask, T + pad, b, ids.device)
            ids, position_ids = ids[:, where], position_ids[:, where]
            padding = None if padding is None else padding[:, where]
            targets = None if targets is None else targets[:, :, where]
        trains = torch.is_grad_enabled() and self.opt is not None
        if not self.pipe.first:  # the previous pipeline stage's hidden states [s, b, h] (s: this rank's share)
            s = ids.shape[1] // (self.parallel.tp if self.parallel.sequence_parallel else 1)
            self.gpt.set_input_tensor(self.pipe.receive((s, b, self.gpt.config.hidden_size), self._dtype, self.device,
                                                        trains))
        self.gpt.post_process = False  # GPTModel then returns the final-normed hidden states [s, b, h]
        try:
            with megatron_glm5.replaying(self.gpt, self.hf_config, targets):
                h = self.gpt(ids, position_ids, mask, **({"padding_mask": padding} if self.glm5 else {}))
        finally:
            self.gpt.post_process = self.pipe.last
        if not self.pipe.last:
            self.pipe.send(h, trains)
            raise StageDone
        if self.parallel.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        if local:
            return h.transpose(0, 1), where
        if cp > 1:
            h = context_parallel.GatherOutput.apply(h)
        return h.transpose(0, 1)[:, :T]

    @staticmethod
    def _segments(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[b, T] document ids (each restart at position 0 begins one), -1 on padding."""
        doc = (position_ids == 0).cumsum(-1)
        return doc if attention_mask is None else doc.masked_fill(attention_mask == 0, -1)

    @staticmethod
    def _document_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[b, 1, T, T], True where a query may not see a key (Megatron's convention): another document, the
        future, padding."""
        n = position_ids.shape[1]
        doc = (position_ids == 0).cumsum(-1)
        allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(n, n, dtype=torch.bool,
                                                                   device=doc.device).tril()
        if attention_mask is not None:
            allowed &= attention_mask[:, None, :].bool()
        allowed |= torch.eye(n, dtype=torch.bool, device=doc.device)  # a padding query sees itself: no NaN
        return ~allowed[:, None]

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.gpt.parameters()).dtype

    def _head_weight(self) -> torch.Tensor:
        return self.gpt.shared_embedding_or_output_weight() if self.tied else self.gpt.output_layer.weight

    def _logits(self, h: torch.Tensor, whole: bool = False) -> tuple[torch.Tensor, int]:
        """This rank's vocabulary slice of the logits for hidden states [n, h], and its first token id. `whole`: `h`
        is the whole sequence's, gathered over context-parallel ranks (`_completion_hidden`)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        w = context_parallel.shared(self._head_weight()) if whole else self._head_weight()
        local = F.linear(copy_to_tensor_model_parallel_region(h, group=ps.get_tensor_model_parallel_group()), w)
        return local, ps.get_tensor_model_parallel_rank() * local.shape[-1]

    def _completion_hidden(self, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden state at each position predicting a completion token [n, h], those tokens [n], the [samples,
        longest] mask of real completion cells they fill in order). With context parallelism the hidden states are
        the whole sequence's on every rank: a weight applied to them takes `context_parallel.shared`."""
        from posttrain.models.prefix import pad_rows
        ids, row, pos = self._rows(samples)
        real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, self.device)
        lengths = torch.tensor([len(s.prompt_ids) + len(s.ids) for s in samples], device=self.device)
        padding = torch.arange(ids.shape[1], device=self.device)[None] >= lengths[:, None]
        if self.routing_replay:
            self._targets = megatron_glm5.replay_targets(samples, ids.shape[1], self.hf_config).to(self.device)
        try:
            return self._hidden(ids, padding=padding)[row, pos], ids[row, pos + 1], real
        finally:
            self._targets = None

    @staged
    def lm_loss(self, batch: dict[str, torch.Tensor], total: torch.Tensor | None = None) -> torch.Tensor:
        """`posttrain.train.masked_lm_loss` on an LM batch (input_ids, loss_mask, optional position_ids and
        attention_mask): the next-token NLL's mean weighted by the target's loss mask, vocab-parallel. With
        context parallelism each rank scores its own slice of the sequence; the value is the whole batch's loss on
        every rank, the gradient that of this rank's share (`_sync_grads` sums the shares). `total`: the weight to
        divide by (a micro-batch's share of a batch: the whole batch's), its own by default."""
        batch = {k: v.to(self.device) for k, v in batch.items() if v is not None}
        ids, weight = batch["input_ids"], batch["loss_mask"]
        if total is None:
            total = weight[:, 1:].float().sum()
        if not bool(total):  # no scored token: a zero loss every rank can still backward
            return next(self.gpt.parameters()).sum() * 0.0
        hidden, where = self._hidden(ids, batch.get("position_ids"), batch.get("attention_mask"), local=True)
        scored = where < ids.shape[1] - 1  # positions with a next token (not the last, not padding)
        h, nxt = hidden[:, scored], where[scored] + 1
        w = weight[:, nxt]
        sel = w != 0
        if bool(sel.any()):
            logp, _ = vocab_parallel.token_scores(*self._logits(h[sel]), self.vocab_size, 1.0,
                                                  target=ids[:, nxt][sel], entropy=False)
            loss = -(logp * w[sel].float()).sum() / total
        else:  # nothing scored in this rank's slice: still part of the graph, for the backward's collectives
            loss = h.sum() * 0.0
        if self.draft is not None and self._mtp_weight and torch.is_grad_enabled():
            loss = loss + self.draft.train_loss(hidden, batch, self._mtp_weight, self._aux, self.moe.aux_loss_weight)
        if context_parallel.size() > 1:
            whole = loss.detach().clone()
            dist.all_reduce(whole, group=context_parallel.group())
            loss = loss + (whole - loss.detach())
        return loss

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """`lm_loss(batch)` times `scale`, backpropagated (one micro-batch of posttrain.train's loop); its value.
        With `micro_batches` > 1 the batch's rows go through in that many micro-batches in the 1F1B order
        (`pipeline_stages.one_f_one_b`): with pipeline stages they work at once, and each holds at most pp
        micro-batches' activations (one without stages). The same loss and gradient as the whole batch at once."""
        ids, positions = batch["input_ids"], batch.get("position_ids")
        total = batch["loss_mask"][:, 1:].float().sum().to(self.device)
        if self.glm5:  # the whole batch's rows refused at once, on every stage, before any micro-batch is sent on
            megatron_glm5.check_rows(self.hf_config, int(positions.max()) + 1 if positions is not None
                                     else ids.shape[1], self.checkpoint, self._sparse)
        rows = ids.shape[0]
        parts = torch.arange(rows).tensor_split(min(self.micro_batches, rows))
        drafting = self.draft is not None and self._mtp_weight
        if drafting:  # its mean over the whole batch's targets, whatever the micro-batches
            self.draft.start(batch)
        if self._aux is not None:  # every stage: the draft's router calls count in the mean
            routed = self._draft_depth and self._mtp_weight and megatron_mtp.routed(self.hf_config)
            self._aux.start(batch, self.moe.aux_loss_weight * scale,
                            megatron_mtp.calls(self._draft_depth, ids.shape[1]) if routed else 0)
        try:
            if len(parts) == 1 or not bool(total):
                self._indexer_weight(scale)
                loss = self.lm_loss(batch) * scale
                self.backward(loss)
                return loss.detach()
            return self._one_f_one_b([{k: v[i] for k, v in batch.items() if v is not None} for i in parts], total,
                                     scale)
        finally:
            if self._aux is not None:
                self._aux.weight = 0.0  # RL's and evaluation's forwards add none
            if drafting:
                self.draft.finish()

    @staged
    def _one_f_one_b(self, micro: list[dict], total: torch.Tensor, scale: float) -> torch.Tensor | None:
        rows = sum(len(m["input_ids"]) for m in micro)

        def forward(i: int) -> torch.Tensor:
            self._indexer_weight(scale * len(micro[i]["input_ids"]) / rows)  # the indexer KL's share of the batch
            return self.lm_loss(micro[i], total) * scale
        return one_f_one_b(self.pipe, forward, len(micro))

    def _indexer_weight(self, share: float) -> None:
        """While the indexers train: the weight of the next forward's indexer losses (the torch ramp's
        `kl_weight` x the micro-batch's share of the step)."""
        if self._dsa is not None:
            self._dsa.weight = self._kl_weight * share

    @staged
    def forward(self, samples) -> torch.Tensor:
        """An LM batch (a dict): its `lm_loss`. Samples: values [samples, longest] for a critic; for a policy the
        full logits [samples, longest, vocab] (gathered over tensor-parallel ranks: for inspection, the losses go
        through `logprobs`)."""
        if isinstance(samples, dict):
            return self.lm_loss(samples)
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
        h, _, real = self._completion_hidden(samples)
        if self.role == "critic":
            v = F.linear(h, *map(context_parallel.shared, (self.value_head.weight, self.value_head.bias)))
            v = v.squeeze(-1).float()
            return v.new_zeros(real.shape).masked_scatter(real, v)
        local, _ = self._logits(h, whole=True)
        logits = gather_from_tensor_model_parallel_region(local, group=ps.get_tensor_model_parallel_group())
        out = logits.new_zeros(*real.shape, self.vocab_size)
        out[real] = logits[:, :self.vocab_size]
        return out

    @staged
    def logprobs(self, samples: list, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        h, target, real = self._completion_hidden(samples)
        logp, ent = vocab_parallel.token_scores(*self._logits(h, whole=True), self.vocab_size, temperature,
                                                target=target)
        return (logp.new_zeros(real.shape).masked_scatter(real, logp),
                ent.new_zeros(real.shape).masked_scatter(real, ent))

    @staged
    def logprob_loss(self, samples: list, temperature: float, loss_of
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logp, ent = self.logprobs(samples, temperature)
        return loss_of(logp, ent), logp.detach(), ent.detach()

    def logprob_losses(self, parts: list[tuple[list, Callable]], temperature: float
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each micro-batch's `logprob_loss`, backpropagated: over pipeline stages in the 1F1B order (the stages
        work at once), else one after the other."""
        if self.pipe.size == 1 or len(parts) == 1:
            return one_by_one(self, parts, temperature)
        flat = self._logprob_1f1b(parts, temperature)
        return [tuple(flat[3 * i:3 * i + 3]) for i in range(len(parts))]

    @staged
    def _logprob_1f1b(self, parts: list[tuple[list, Callable]], temperature: float) -> tuple[torch.Tensor, ...] | None:
        """The last stage's (loss, logp, ent) of every micro-batch, flat (`staged` shares them with every stage)."""
        kept = {}

        def forward(i: int) -> torch.Tensor:
            samples, loss_of = parts[i]
            logp, ent = self.logprobs(samples, temperature)
            loss = loss_of(logp, ent)
            kept[i] = (loss.detach(), logp.detach(), ent.detach())
            return loss
        one_f_one_b(self.pipe, forward, len(parts))
        return tuple(t for i in range(len(parts)) for t in kept[i]) if self.pipe.last else None

    @staged
    def reverse_kl_loss(self, samples: list, teacher: list[torch.Tensor], temperature: float,
                        token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-vocabulary KL(policy || teacher) at the generated positions, vocab-parallel."""
        from posttrain.models.prefix import pad_rows
        h, _, real = self._completion_hidden(samples)
        gen = pad_rows([s.gen_mask for s in samples], 0, device=self.device) > 0
        teacher = torch.cat([t.float() for t in teacher]).to(self.device)
        kl = vocab_parallel.reverse_kl(*self._logits(h[gen[real]], whole=True), self.vocab_size, temperature,
                                       teacher=teacher)
        w = token_weights.to(self.device)[gen].float()
        return (kl * w).sum(), kl.detach().new_zeros(gen.shape).masked_scatter(gen, kl.detach())

    def replay_stats(self) -> dict[str, float]:
        """Routes replayed since the last call and the share the router would have chosen otherwise (every pipeline
        stage's routers); {} without replay or when none was replayed."""
        if not self.routing_replay:
            return {}
        from megatron.core import parallel_state as ps
        got = torch.tensor(megatron_glm5.take_replayed(self.gpt, self.hf_config), dtype=torch.float64)
        if self.pipe.size > 1:
            dist.all_reduce(got, group=ps.get_pipeline_model_parallel_group())
        n, differ = got.tolist()
        return {"routes_replayed": n, "routes_differ": differ / n} if n else {}

    # --- training ----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self.pipe.backward(loss)

    def _sync_grads(self) -> None:
        from megatron.core import parallel_state as ps
        if (self.tied or self._draft_copy is not None or self._draft_depth and self.pipe.first) and \
                self.pipe.size > 1 and ps.is_rank_in_embedding_group():
            # the first stage's embeddings and the last stage's copy of them (its output layer when tied, else the
            # draft layer's): one weight, whose gradient is the sum of both uses
            w = self.gpt.shared_embedding_or_output_weight() if self.tied or self.pipe.first else self._draft_copy
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=ps.get_embedding_group())
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.parallel.sequence_parallel:  # norms saw their rank's slice of the sequence: sum the slices
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        # the replicas' gradients are averaged; a replica's context-parallel ranks each hold the gradient of their
        # slice of the sequence, which add up. An expert split over expert-parallel ranks already holds the gradient
        # of every token the all-to-all sent it, from each of those ranks: it sums over its own replicas only
        dp = ps.get_data_parallel_world_size()
        for shared, group in ((True, ps.get_data_parallel_group(with_context_parallel=True)),
                              (False, ps.get_expert_data_parallel_group() if self.glm5 else None)):
            mine = [p for p in params if getattr(p, "allreduce", True) == shared]
            if not mine or dp == 1 and context_parallel.size() == 1:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in mine]) / dp
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            at = 0
            for p in mine:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()

    def _grad_norm(self) -> torch.Tensor:
        from megatron.core import parallel_state as ps
        sharded = torch.zeros((), device=self.device)
        replicated = torch.zeros((), device=self.device)
        experts = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            if p.grad is None or getattr(p, "shared", False):  # the last stage's copy of tied embeddings: once
                continue
            sq = p.grad.float().pow(2).sum()
            if not getattr(p, "allreduce", True):  # an expert split over expert-parallel ranks
                experts += sq
            elif getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.parallel.tp > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        if self.parallel.ep > 1:
            dist.all_reduce(experts, group=ps.get_expert_tensor_and_model_parallel_group())
        total = sharded + replicated + experts
        if self.pipe.size > 1:  # each stage holds its own layers
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        return total.sqrt()

    def step(self, max_grad_norm: float = 1.0) -> float:
        self._sync_grads()
        norm = self._grad_norm()
        coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        self.opt.step()
        if self.shards:
            self.shards.broadcast()
        if self.sched:
            self.sched.step()
        self.model.zero_grad(set_to_none=True)  # the distributed optimizer's holds only its own parameters
        self.pipe.forget()
        if self._balance:
            self.moe_stats = megatron_glm5.balance_experts(self.gpt, self.hf_config, self.moe.bias_update_rate,
                                                           self.parallel.sequence_parallel, self.pipe.size,
                                                           self.draft)
            self.moe_stats |= self._aux.pop(self.pipe.size) if self._aux else {}
        if self._dsa is not None:
            self.indexer_stats = megatron_dsa.pop_stats(self._dsa, self.pipe.size)
        if self._draft_depth:
            self.mtp_stats = megatron_mtp.pop_stats(self.draft, self.pipe)
        return norm.item()

    def with_schedule(self, schedule: Callable[[int], float], lr: float) -> "MegatronTrainEngine":
        """`lr` times `schedule(step)` from now on (posttrain.train's warmup + cosine)."""
        for group in self.opt.param_groups:
            group["lr"] = group["initial_lr"] = lr
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        return self

    def zero_grad(self) -> None:
        self.pipe.forget()
        if self.opt is not None:
            self.model.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights under their Hugging Face names (gathered over tensor-parallel ranks; every rank
        returns them), on CPU for the rollout engines."""
        with torch.no_grad():  # mbridge broadcasts the parameters themselves over the pipeline group: not for autograd
            out = {name: t.detach().cpu().clone() for name, t in self.bridge.export_weights([self.gpt])}
        if self.glm5:  # one tensor per layer's experts, as transformers holds them
            out = megatron_glm5.to_transformers(out)
        out |= self._passthrough  # what no module here holds
        if self.tied and "lm_head.weight" not in out:  # transformers lists the tied head in its state dict
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        if self._draft_depth:  # under transformers' in-memory names (models.mtp's module), from the last stage
            out |= megatron_mtp.export(self.draft, self.pipe)
        return out

    def hf_model(self) -> torch.nn.Module:
        """The checkpoint's transformers model holding the current weights (loaded once, refreshed each call):
        what validation generates from and what the stage saves."""
        from posttrain.models.preset import load_checkpoint
        if self._hf is None:
            self._hf = load_checkpoint(self.checkpoint)[0].eval()
        self._hf.load_state_dict(self.weights())
        return self._hf

    def state_dict(self) -> dict:
        """This rank's shards, optimizer moments, schedule and RNG (each rank keeps its own)."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict() if self.opt else None,
                "sched": self.sched.state_dict() if self.sched else None, "rng": torch.get_rng_state(),
                "python_rng": random.getstate()}

    def save_sharded(self, folder: str | Path) -> None:
        """A Megatron distributed checkpoint (dist_checkpointing, torch_dist) of the policy in `folder`: weights and
        AdamW moments as sharded tensors, so it loads at another tp / cp split; the schedule, step count and RNG in
        its common part. Every rank calls it (a collective); each writes its own shards."""
        from megatron.core import dist_checkpointing
        Path(folder).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self._sharded(), str(folder), preprocess_common_before_consistancy_check=_without_rng)

    def load_sharded(self, folder: str | Path) -> None:
        """`save_sharded`'s checkpoint into this engine, whatever split it was saved at (every rank calls it)."""
        from megatron.core import dist_checkpointing
        got = dist_checkpointing.load(self._sharded(), str(folder))
        model = got["model"]
        if self.draft is not None:
            self.draft.module.load_state_dict({k.removeprefix(DRAFT): model.pop(k) for k in list(model)
                                               if k.startswith(DRAFT)})
        if self._draft_copy is not None:
            self._draft_copy.data.copy_(model.pop(DRAFT_EMBEDDING))
        self.gpt.load_state_dict(model)
        opt = got["optimizer"]
        for st in opt["state"].values():
            st["step"] = torch.tensor(float(got["common"]["opt_step"]))
        self.opt.load_state_dict(opt)
        if self.sched is not None:
            self.sched.load_state_dict(got["common"]["sched"])
        torch.set_rng_state(got["common"]["rng"])
        random.setstate(got["common"]["python_rng"])

    def _sharded(self) -> dict:
        """The policy's sharded state dict (optimizer moments sharded as their parameters), its template on load."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                 optim_state_to_sharding_state)
        if self.role != "policy" or self.opt is None:
            raise ValueError(f"megatron: a distributed checkpoint holds a trained policy (this engine: {self.role})")
        params = [p for g in self.opt.param_groups for p in g["params"]]
        for p in params:  # a template needs every moment, also before the first step
            if not self.opt.state[p]:
                self.opt.state[p] = {"step": torch.zeros((), device=p.device), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
        model = self.gpt.sharded_state_dict()
        if self.draft is not None:
            model |= self.draft.sharded_state_dict(DRAFT)
        if self._draft_copy is not None:  # stage one's embedding, as Megatron saves a tied output layer
            model[DRAFT_EMBEDDING] = megatron_mtp.sharded_copy(self._draft_copy)
        opt = self.opt.state_dict()
        step = float(next(iter(opt["state"].values()))["step"]) if opt["state"] else 0.0
        optim_state_to_sharding_state(opt, get_param_id_to_sharded_param_map(model, params), exclude_keys=("step",))
        if self.shards:  # each moment on its owner only
            opt["state"] = {i: {k: zero_optimizer.owned_moment(v) for k, v in st.items()}
                            for i, st in opt["state"].items()}
        return {"model": model, "optimizer": opt,
                "common": {"opt_step": step, "sched": self.sched.state_dict() if self.sched else None,
                           "rng": torch.get_rng_state(), "python_rng": random.getstate()}}

    def load_state_dict(self, state: dict) -> None:
        if "dist_checkpoint" in state:  # sft's checkpoints: a folder of save_sharded
            return self.load_sharded(state["dist_checkpoint"])
        self.model.load_state_dict(state["model"])
        if self.opt is not None:
            self.opt.load_state_dict(state["opt"])
        if self.sched is not None:
            self.sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])
        random.setstate(state["python_rng"])

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()
