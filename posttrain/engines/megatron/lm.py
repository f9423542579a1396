"""The megatron engine's LM loss (base, the ramp and sft), as the torch engine computes it: the next-token NLL's mean
weighted by the target's loss mask, vocab-parallel, and beside it, as gradients only, the draft (MTP) layer's loss
(`mtp`), the routers' sequence-wise balance loss (`glm5.SeqAux`) and, while the ramp adopts DSA, the indexers' KL
(`dsa`). A batch goes through in micro-batches of rows in Megatron's 1F1B order (`pipeline_stages.one_f_one_b`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from posttrain.engines.megatron import context_parallel, mtp, pipeline_stages, vocab_parallel
from posttrain.engines.megatron.forward import Forward
from posttrain.engines.megatron.glm5 import SeqAux
from posttrain.engines.megatron.pipeline_stages import staged


class LMLoss:
    """The LM loss on `fwd`'s model. `draft`: the checkpoint's draft layer on this stage (the last), trained at
    `mtp_weight`, `depth` draft steps (every stage knows it: the balance loss counts its router calls); `aux`: the
    balance loss at `aux_weight`; `kl_weight`: the indexers' KL while they train (`fwd.dsa`)."""

    def __init__(self, fwd: Forward, micro_batches: int = 1, *, draft: mtp.Draft | None = None, depth: int = 0,
                 mtp_weight: float = 0.0, aux: SeqAux | None = None, aux_weight: float = 0.0, kl_weight: float = 0.0):
        self.fwd, self.pipe, self.device = fwd, fwd.pipe, fwd.device  # `staged` reads pipe and device
        self.micro_batches = micro_batches
        self.draft, self.depth, self.mtp_weight = draft, depth, mtp_weight
        self.aux, self.aux_weight, self.kl_weight = aux, aux_weight, kl_weight

    @staged
    def loss(self, batch: dict[str, torch.Tensor], total: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of an LM batch (input_ids, loss_mask, optional position_ids and attention_mask). With context
        parallelism each rank scores its own slice of the sequence; the value is the whole batch's loss on every
        rank, the gradient that of this rank's share (the optimizer sums the shares). `total`: the weight to divide
        by (a micro-batch's share of a batch: the whole batch's), its own by default."""
        fwd = self.fwd
        batch = {k: v.to(self.device) for k, v in batch.items() if v is not None}
        ids, weight = batch["input_ids"], batch["loss_mask"]
        if total is None:
            total = weight[:, 1:].float().sum()
        if not bool(total):  # no scored token: a zero loss every rank can still backward
            return next(fwd.gpt.parameters()).sum() * 0.0
        hidden, where = fwd.hidden(ids, batch.get("position_ids"), batch.get("attention_mask"), local=True)
        scored = where < ids.shape[1] - 1  # positions with a next token (not the last, not padding)
        h, nxt = hidden[:, scored], where[scored] + 1
        w = weight[:, nxt]
        sel = w != 0
        if bool(sel.any()):
            logp, _ = vocab_parallel.token_scores(*fwd.logits(h[sel]), fwd.vocab_size, 1.0,
                                                  target=ids[:, nxt][sel], entropy=False)
            loss = -(logp * w[sel].float()).sum() / total
        else:  # nothing scored in this rank's slice: still part of the graph, for the backward's collectives
            loss = h.sum() * 0.0
        if self.draft is not None and self.mtp_weight and torch.is_grad_enabled():
            loss = loss + self.draft.train_loss(hidden, batch, self.mtp_weight, self.aux, self.aux_weight)
        if context_parallel.size() > 1:
            whole = loss.detach().clone()
            dist.all_reduce(whole, group=context_parallel.group())
            loss = loss + (whole - loss.detach())
        return loss

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """`loss(batch)` times `scale`, backpropagated; its value. With `micro_batches` > 1 the batch's rows go
        through in that many micro-batches in the 1F1B order: with pipeline stages they work at once, and each
        holds at most pp micro-batches' activations (one without stages). The same loss and gradient as the whole
        batch at once."""
        ids, positions = batch["input_ids"], batch.get("position_ids")
        total = batch["loss_mask"][:, 1:].float().sum().to(self.device)
        if self.fwd.glm5:  # the whole batch's rows refused at once, on every stage, before any micro-batch is sent on
            self.fwd.check_rows(int(positions.max()) + 1 if positions is not None else ids.shape[1])
        rows = ids.shape[0]
        parts = torch.arange(rows).tensor_split(min(self.micro_batches, rows))
        drafting = self.draft is not None and self.mtp_weight
        if drafting:  # its mean over the whole batch's targets, whatever the micro-batches
            self.draft.start(batch)
        if self.aux is not None:  # every stage: the draft's router calls count in the mean
            routed = self.depth and self.mtp_weight and mtp.routed(self.fwd.hf_config)
            self.aux.start(batch, self.aux_weight * scale, mtp.calls(self.depth, ids.shape[1]) if routed else 0)
        try:
            if len(parts) == 1 or not bool(total):
                self._indexer_weight(scale)
                loss = self.loss(batch) * scale
                self.pipe.backward(loss)
                return loss.detach()
            return self._one_f_one_b([{k: v[i] for k, v in batch.items() if v is not None} for i in parts], total,
                                     scale)
        finally:
            if self.aux is not None:
                self.aux.weight = 0.0  # RL's and evaluation's forwards add none
            if drafting:
                self.draft.finish()

    @staged
    def _one_f_one_b(self, micro: list[dict], total: torch.Tensor, scale: float) -> torch.Tensor | None:
        rows = sum(len(m["input_ids"]) for m in micro)

        def forward(i: int) -> torch.Tensor:
            self._indexer_weight(scale * len(micro[i]["input_ids"]) / rows)  # the indexer KL's share of the batch
            return self.loss(micro[i], total) * scale
        return pipeline_stages.one_f_one_b(self.pipe, forward, len(micro))

    def _indexer_weight(self, share: float) -> None:
        """While the indexers train: the weight of the next forward's indexer losses (the torch ramp's
        `kl_weight` x the micro-batch's share of the step)."""
        if self.fwd.dsa is not None:
            self.fwd.dsa.weight = self.kl_weight * share
