"""The megatron engine's forward: this rank's part of the model run over the engine's rows, and the policy's and the
critic's outputs at the positions that predict a completion token.

Rows are each sample's prompt and completion, right-padded, under a causal mask; packed rows (`position_ids`
restarting at 0) attend per document. The sequence is padded to what the split needs (a multiple of tp with sequence
parallelism, of 2 x cp with context parallelism) and, with context parallelism, cut into this rank's chunks
(`context_parallel`). The head runs vocab-parallel (`vocab_parallel`): each tensor-parallel rank holds a slice of the
output embeddings and scores its slice of the vocabulary.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from posttrain.engines.megatron import context_parallel, glm5, vocab_parallel
from posttrain.engines.megatron.layout import Parallel, local_spec
from posttrain.engines.megatron.pipeline_stages import Pipeline, StageDone
from posttrain.models.prefix import pad_rows

# Rows longer than this attend per document (`context_parallel.document_attention`, Megatron's local layers) instead of
# through one [T, T] mask: at 2k tokens a mask is 4 MB a row, at 128k 16 GB, and on CUDA a mask keeps SDPA off its
# flash kernel. Transformer Engine's layers (cp 1 where it is installed) still take the mask.
DENSE_MASK_MAX = 2048


def segments(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[b, T] document ids (each restart at position 0 begins one), -1 on padding."""
    doc = (position_ids == 0).cumsum(-1)
    return doc if attention_mask is None else doc.masked_fill(attention_mask == 0, -1)


def document_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[b, 1, T, T], True where a query may not see a key (Megatron's convention): another document, the future,
    padding."""
    n = position_ids.shape[1]
    doc = (position_ids == 0).cumsum(-1)
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    if attention_mask is not None:
        allowed &= attention_mask[:, None, :].bool()
    allowed |= torch.eye(n, dtype=torch.bool, device=doc.device)  # a padding query sees itself: no NaN
    return ~allowed[:, None]


class Forward:
    """This rank's GPTModel `gpt` (its pipeline stage's layers) run forward. `trains`: the engine steps an optimizer
    (a stage then keeps what it receives for the backward); `replay`: completions go through the experts their
    rollout chose (posttrain.routing_replay); `sparse`: GLM-5's layers run the DSA indexer."""

    def __init__(self, gpt, pipe: Pipeline, parallel: Parallel, hf_config, checkpoint: str | Path, device, pad_id: int,
                 *, trains: bool, replay: bool = False, sparse: bool = False):
        self.gpt, self.pipe, self.parallel, self.hf_config = gpt, pipe, parallel, hf_config
        self.checkpoint, self.device, self.pad_id = str(checkpoint), device, pad_id
        self.trains, self.replay, self.sparse = trains, replay, sparse
        self.glm5 = hf_config.model_type in glm5.MODEL_TYPES
        self.vocab_size = hf_config.vocab_size
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.dsa = None  # the indexers' training state (`dsa.train_indexers`), while they train
        self.targets: torch.Tensor | None = None  # the rollout's routes for the next forward

    def check_rows(self, length: int) -> None:
        """Refuse rows of `length` tokens this model would attend to otherwise than the checkpoint (GLM-5)."""
        if self.glm5:
            glm5.check_rows(self.hf_config, length, self.checkpoint, self.sparse)

    def rows(self, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded rows of prompt + completion, and (row, position) of each position that predicts a
        completion token, in sample order then token order."""
        rows = [list(s.prompt_ids) + list(s.ids) for s in samples]
        T = max(map(len, rows))
        ids = torch.tensor([r + [self.pad_id] * (T - len(r)) for r in rows], device=self.device)
        row = torch.tensor([i for i, s in enumerate(samples) for _ in s.ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([len(s.prompt_ids) - 1 + j for s in samples for j in range(len(s.ids))],
                           dtype=torch.long, device=self.device)
        return ids, row, pos

    @property
    def dtype(self) -> torch.dtype:
        return next(self.gpt.parameters()).dtype

    def hidden(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None, local: bool = False, padding: torch.Tensor | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The decoder's last hidden state (after the final norm) [b, T, h], the full sequence on every rank.
        Without `position_ids` each row is one sequence; with them each restart at 0 begins a new document that
        attends only to itself (packed rows: Megatron's block-diagonal mask, since its packed-sequence kernels need
        Transformer Engine); `attention_mask` (1 = token, 0 = padding) keeps padding out.
        `local`: (this context-parallel rank's hidden states [b, s, h], their sequence positions [s]) instead; with
        one context-parallel rank that is the whole sequence. `padding` [b, T] (True: padding) keeps padding out of
        the experts' load (`attention_mask`'s zeros when not given). A stage before the last sends its hidden
        states on and raises StageDone."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        b, T = ids.shape
        if self.glm5:
            self.check_rows(int(position_ids.max()) + 1 if position_ids is not None else T)
            if padding is None and attention_mask is not None:
                padding = attention_mask == 0
        cp = context_parallel.size()
        if self.dsa is not None:  # the indexer loss samples its queries over the rows' own length
            self.dsa.length = T
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
        targets = self.targets
        if targets is not None and pad:
            targets = F.pad(targets, (0, 0, 0, pad), value=-1)
        if T + pad > DENSE_MASK_MAX and (cp > 1 or not causal) and local_spec(self.parallel):  # per document
            mask = segments(position_ids, attention_mask)
            mask[:, T:] = -1
        else:
            mask = None if causal else document_mask(position_ids, attention_mask)
        where = torch.arange(T + pad, device=ids.device)
        if cp > 1:  # this rank's chunks of every row; attention sees the whole sequence's keys (context_parallel)
            where = context_parallel.positions(T + pad, cp, ps.get_context_parallel_rank(), ids.device)
            if mask is None or mask.dtype == torch.bool:
                mask = context_parallel.local_mask(mask, T + pad, b, ids.device)
            ids, position_ids = ids[:, where], position_ids[:, where]
            padding = None if padding is None else padding[:, where]
            targets = None if targets is None else targets[:, :, where]
        trains = torch.is_grad_enabled() and self.trains
        if not self.pipe.first:  # the previous pipeline stage's hidden states [s, b, h] (s: this rank's share)
            s = ids.shape[1] // (self.parallel.tp if self.parallel.sequence_parallel else 1)
            self.gpt.set_input_tensor(self.pipe.receive((s, b, self.gpt.config.hidden_size), self.dtype, self.device,
                                                        trains))
        self.gpt.post_process = False  # GPTModel then returns the final-normed hidden states [s, b, h]
        try:
            with glm5.replaying(self.gpt, self.hf_config, targets):
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

    def head_weight(self) -> torch.Tensor:
        return self.gpt.shared_embedding_or_output_weight() if self.tied else self.gpt.output_layer.weight

    def logits(self, h: torch.Tensor, whole: bool = False) -> tuple[torch.Tensor, int]:
        """This rank's vocabulary slice of the logits for hidden states [n, h], and its first token id. `whole`: `h`
        is the whole sequence's, gathered over context-parallel ranks (`completion_hidden`)."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        w = context_parallel.shared(self.head_weight()) if whole else self.head_weight()
        local = F.linear(copy_to_tensor_model_parallel_region(h, group=ps.get_tensor_model_parallel_group()), w)
        return local, ps.get_tensor_model_parallel_rank() * local.shape[-1]

    def completion_hidden(self, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden state at each position predicting a completion token [n, h], those tokens [n], the [samples,
        longest] mask of real completion cells they fill in order). With context parallelism the hidden states are
        the whole sequence's on every rank: a weight applied to them takes `context_parallel.shared`."""
        ids, row, pos = self.rows(samples)
        real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, self.device)
        lengths = torch.tensor([len(s.prompt_ids) + len(s.ids) for s in samples], device=self.device)
        padding = torch.arange(ids.shape[1], device=self.device)[None] >= lengths[:, None]
        if self.replay:
            self.targets = glm5.replay_targets(samples, ids.shape[1], self.hf_config).to(self.device)
        try:
            return self.hidden(ids, padding=padding)[row, pos], ids[row, pos + 1], real
        finally:
            self.targets = None

    # --- what the RL losses, OPD and the critic read at the completion positions -----------------------------------
    def values(self, samples: list, head: torch.nn.Linear) -> torch.Tensor:
        """A critic's values [samples, longest] from its value `head` on the backbone's last hidden state."""
        h, _, real = self.completion_hidden(samples)
        v = F.linear(h, *map(context_parallel.shared, (head.weight, head.bias))).squeeze(-1).float()
        return v.new_zeros(real.shape).masked_scatter(real, v)

    def full_logits(self, samples: list) -> torch.Tensor:
        """The policy's logits [samples, longest, vocab], gathered over tensor-parallel ranks (for inspection: the
        losses go through `logprobs`)."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
        h, _, real = self.completion_hidden(samples)
        local, _ = self.logits(h, whole=True)
        logits = gather_from_tensor_model_parallel_region(local, group=ps.get_tensor_model_parallel_group())
        out = logits.new_zeros(*real.shape, self.vocab_size)
        out[real] = logits[:, :self.vocab_size]
        return out

    def logprobs(self, samples: list, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probability, entropy) of each completion token [samples, longest], vocab-parallel."""
        h, target, real = self.completion_hidden(samples)
        logp, ent = vocab_parallel.token_scores(*self.logits(h, whole=True), self.vocab_size, temperature,
                                                target=target)
        return (logp.new_zeros(real.shape).masked_scatter(real, logp),
                ent.new_zeros(real.shape).masked_scatter(real, ent))

    def reverse_kl(self, samples: list, teacher: list[torch.Tensor], temperature: float,
                   token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-vocabulary KL(policy || teacher) at the generated positions, vocab-parallel: (its sum weighted by
        `token_weights`, the KL detached [samples, longest])."""
        h, _, real = self.completion_hidden(samples)
        gen = pad_rows([s.gen_mask for s in samples], 0, device=self.device) > 0
        teacher = torch.cat([t.float() for t in teacher]).to(self.device)
        kl = vocab_parallel.reverse_kl(*self.logits(h[gen[real]], whole=True), self.vocab_size, temperature,
                                       teacher=teacher)
        w = token_weights.to(self.device)[gen].float()
        return (kl * w).sum(), kl.detach().new_zeros(gen.shape).masked_scatter(gen, kl.detach())
