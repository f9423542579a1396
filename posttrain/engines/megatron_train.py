"""The Megatron-core train engine: the policy, the PPO critic or the KL reference as a megatron-core GPTModel split
over ranks (tensor parallel, optionally sequence parallel; data parallel over the remaining ranks), loaded from and
exported to Hugging Face tensors through mbridge (`engines.megatron_setup`).

Each rank holds one `MegatronTrainEngine` and runs every call in step with the others (SPMD): torch.distributed over
gloo on CPU, NCCL on CUDA. One process without a launcher is a world of one rank.

Scoring is vocab-parallel: each tensor-parallel rank holds a slice of the output embeddings, and the log-probability
and entropy of a token come from per-slice maxima and sums reduced over the tensor-parallel group (as Megatron's own
`vocab_parallel_cross_entropy`, which gives no entropy), so no rank builds the full [tokens, vocab] logits. Rows are
each sample's prompt and completion, right-padded, under a causal mask; the head runs only at the positions that
predict a completion token.

Gradients: the data-parallel ranks' gradients are averaged with one all-reduce per step; with sequence parallelism
the norms' gradients (computed on each rank's slice of the sequence) are summed over the tensor-parallel group, as
Megatron's DDP does. The optimizer is torch's fused AdamW on each rank's own parameters (the torch engine's), and
the clipping norm counts tensor-parallel shards once each. Megatron's own DDP and distributed optimizer hard-code
CUDA devices and streams, so they are not used here.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.engines.megatron_setup import Parallel, bridge, check_layout, init_parallel


def _tp():
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_rank()


def vocab_parallel_scores(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size: int,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of `target`, entropy) from this rank's vocabulary slice of the logits [n, V/tp], starting at
    global id `vocab_start`; ids at or past `vocab_size` (the padding to a multiple of tp) never score."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as local_use
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as sum_tp
    group, world, _ = _tp()
    z = logits.float() / temperature
    ids = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
    z = z.masked_fill(ids >= vocab_size, float("-inf"))
    top = z.detach().max(-1, keepdim=True).values
    if world > 1:
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
    e = (z - top).exp()
    log_z = top.squeeze(-1) + sum_tp(e.sum(-1)).log()
    local = target - vocab_start
    here = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1)
    logp = sum_tp(torch.where(here, picked, torch.zeros_like(picked))) - log_z
    # log Z feeds every rank's own slice of p: those uses' gradients are summed over the ranks (local_use's backward)
    p = (z - local_use(log_z)[:, None]).exp()
    ent = log_z - sum_tp(torch.where(p > 0, p * z, torch.zeros_like(p)).sum(-1))
    return logp, ent


class MegatronTrainEngine:
    """A checkpoint as a Megatron GPTModel on this rank: `policy` (AdamW at `lr`), `critic` (a zero-initialised value
    head on the backbone's last hidden state) or `reference` (forward only)."""

    def __init__(self, checkpoint: str | Path, role: str = "policy", *, lr: float | None = None,
                 parallel: Parallel = Parallel(), weight_decay: float = 0.0, seed: int = 0):
        from transformers import AutoConfig, AutoTokenizer

        from posttrain.chat import pad_id
        from posttrain.device import device as default_device
        from posttrain.models.preset import check_folder
        check_folder(checkpoint)
        hf_config = AutoConfig.from_pretrained(checkpoint)
        check_layout(hf_config, parallel)
        init_parallel(parallel, seed)
        self.parallel, self.role, self.checkpoint = parallel, role, str(checkpoint)
        self.device = default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.pad_id = pad_id(self.tokenizer)
        self.bridge = bridge(hf_config, parallel)
        self.gpt = self.bridge._model_provider([])(pre_process=True, post_process=True).to(self.device)
        self.bridge.load_weights([self.gpt], str(checkpoint))
        self.vocab_size = hf_config.vocab_size
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        modules = {"gpt": self.gpt}
        if role == "critic":
            self.value_head = torch.nn.Linear(hf_config.hidden_size, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)  # predicts 0 everywhere at first, as the torch critic
            torch.nn.init.zeros_(self.value_head.bias)
            modules["value_head"] = self.value_head
        self.model = torch.nn.ModuleDict(modules)
        self.opt = None
        if lr is not None and role != "reference":
            from posttrain.train import make_optimizer
            self.opt = make_optimizer(self.model, lr, weight_decay)
        else:
            self.model.requires_grad_(False)
        self.eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, role: str = "policy", *, lr: float | None = None, moe=None,
                        routing_replay: bool = False, parallel: Parallel = Parallel()) -> "MegatronTrainEngine":
        if routing_replay:
            raise ValueError("rl.routing_replay: the megatron train engine maps dense models only (no routers); "
                             "use runtime.train_engine torch")
        return cls(path, role, lr=lr, parallel=parallel)

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

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden state (after the final norm) [b, T, h], the full sequence on every rank."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        b, T = ids.shape
        pad = (-T) % self.parallel.tp if self.parallel.sequence_parallel else 0  # SP splits the sequence over tp
        if pad:
            ids = F.pad(ids, (0, pad), value=self.pad_id)
        n = ids.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), 1)[None, None].expand(b, 1, n, n)
        pos = torch.arange(n, device=ids.device)[None].expand(b, n)
        self.gpt.post_process = False  # GPTModel then returns the final-normed hidden states [s, b, h]
        try:
            h = self.gpt(ids, pos, mask)
        finally:
            self.gpt.post_process = True
        if self.parallel.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        return h.transpose(0, 1)[:, :T]

    def _head_weight(self) -> torch.Tensor:
        return self.gpt.shared_embedding_or_output_weight() if self.tied else self.gpt.output_layer.weight

    def _local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits for hidden states [n, h]."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
        return F.linear(copy_to_tensor_model_parallel_region(h), self._head_weight())

    def _scores(self, samples: list, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy) of each completion token, flat, and the [samples, longest] mask they scatter into."""
        from posttrain.models.prefix import pad_rows
        ids, row, pos = self._rows(samples)
        h = self._hidden(ids)[row, pos]
        _, _, rank = _tp()
        local = self._local_logits(h)
        target = ids[row, pos + 1]
        logp, ent = vocab_parallel_scores(local, target, rank * local.shape[-1], self.vocab_size, temperature)
        real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, self.device)
        return logp, ent, real

    def forward(self, samples: list) -> torch.Tensor:
        """Values [samples, longest] for a critic; for a policy the full logits [samples, longest, vocab] (gathered
        over tensor-parallel ranks: for inspection, the losses go through `logprobs`)."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
        from posttrain.models.prefix import pad_rows
        ids, row, pos = self._rows(samples)
        h = self._hidden(ids)[row, pos]
        real = pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, self.device)
        if self.role == "critic":
            v = self.value_head(h).squeeze(-1).float()
            return v.new_zeros(real.shape).masked_scatter(real, v)
        logits = gather_from_tensor_model_parallel_region(self._local_logits(h))[:, :self.vocab_size]
        out = logits.new_zeros(*real.shape, logits.shape[-1])
        out[real] = logits
        return out

    def logprobs(self, samples: list, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        logp, ent, real = self._scores(samples, temperature)
        return logp.new_zeros(real.shape).masked_scatter(real, logp), ent.new_zeros(real.shape).masked_scatter(real, ent)

    def logprob_loss(self, samples: list, temperature: float, loss_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logp, ent = self.logprobs(samples, temperature)
        return loss_of(logp, ent), logp.detach(), ent.detach()

    def reverse_kl_loss(self, samples: list, teacher: list[torch.Tensor], temperature: float,
                        token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-vocabulary KL(policy || teacher) at the generated positions; each rank takes its vocabulary
        slice of the teacher's log-probabilities, the sums reduce over the tensor-parallel group."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as local_use
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as sum_tp
        from posttrain.models.prefix import pad_rows
        ids, row, pos = self._rows(samples)
        gen = pad_rows([s.gen_mask for s in samples], 0, device=self.device) > 0
        flat_gen = gen[pad_rows([[True] * len(s.ids) for s in samples], False, torch.bool, self.device)]
        local = self._local_logits(self._hidden(ids)[row[flat_gen], pos[flat_gen]])
        _, _, rank = _tp()
        start, width = rank * local.shape[-1], local.shape[-1]
        z = (local.float() / temperature).masked_fill(
            torch.arange(start, start + width, device=self.device) >= self.vocab_size, float("-inf"))
        top = z.detach().max(-1, keepdim=True).values
        if self.parallel.tp > 1:
            dist.all_reduce(top, dist.ReduceOp.MAX, group=_tp()[0])
        log_z = top + sum_tp((z - top).exp().sum(-1, keepdim=True)).log()
        ls = z - local_use(log_z)  # as in vocab_parallel_scores
        lt = torch.cat([t.float() for t in teacher]).to(self.device)
        lt = F.pad(lt, (0, start + width - lt.shape[-1]), value=float("-inf"))[:, start:start + width] \
            if lt.shape[-1] < start + width else lt[:, start:start + width]
        p = ls.exp()
        kl = sum_tp(torch.where(p > 0, p * (ls - lt), torch.zeros_like(p)).sum(-1))
        w = token_weights.to(self.device)[gen].float()
        return (kl * w).sum(), kl.detach().new_zeros(gen.shape).masked_scatter(gen, kl.detach())

    # --- training ----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _sync_grads(self) -> None:
        from megatron.core import parallel_state as ps
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.parallel.sequence_parallel:  # norms saw their rank's slice of the sequence: sum the slices
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        if dp > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params]) / dp
            dist.all_reduce(flat, group=ps.get_data_parallel_group(with_context_parallel=True))
            at = 0
            for p in params:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()

    def _grad_norm(self) -> torch.Tensor:
        from megatron.core import parallel_state as ps
        sharded = torch.zeros((), device=self.device)
        shared = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sq = p.grad.float().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                shared += sq
        if self.parallel.tp > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        return (sharded + shared).sqrt()

    def step(self, max_grad_norm: float = 1.0) -> float:
        self._sync_grads()
        norm = self._grad_norm()
        coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm.item()

    def zero_grad(self) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights under their Hugging Face names (gathered over tensor-parallel ranks; every rank
        returns them), on CPU for the rollout engines."""
        out = {name: t.detach().cpu().clone() for name, t in self.bridge.export_weights([self.gpt])}
        if self.tied and "lm_head.weight" not in out:  # transformers lists the tied head in its state dict
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def save_hf(self, out: str | Path) -> None:
        """A Hugging Face folder of the current weights (rank 0 writes), the checkpoint's config and tokenizer."""
        from transformers import AutoModelForCausalLM
        w = self.weights()
        if dist.get_rank() == 0:
            from posttrain.models.preset import load_pretrained, save_checkpoint
            model = load_pretrained(AutoModelForCausalLM, self.checkpoint)
            model.load_state_dict(w)
            save_checkpoint(model, self.tokenizer, out)
        dist.barrier()

    def state_dict(self) -> dict:
        """This rank's shards, optimizer moments and RNG (each rank keeps its own)."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict() if self.opt else None,
                "rng": torch.get_rng_state(), "python_rng": random.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.opt is not None:
            self.opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
        random.setstate(state["python_rng"])

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()
