"""The Megatron-core train engine: the policy, the PPO critic or the KL reference as a megatron-core GPTModel split
over ranks (tensor parallel, optionally sequence parallel; context parallel; pipeline stages; expert parallel; data
parallel over the remaining ranks), loaded from and exported to Hugging Face tensors through mbridge.

Each rank holds one `MegatronTrainEngine` and runs every call in step with the others (SPMD): torch.distributed over
gloo on CPU, NCCL on CUDA. One process without a launcher is a world of one rank.

`MegatronTrainEngine` is the `TrainEngine` facade over the package's parts: `layout` (the split, process groups,
bridges), `forward` (rows, masks, hidden states, padding for the split, vocab-parallel logits), `lm` (the LM loss with
the draft layer's, the balance loss and the indexers' KL), `optimizer` (gradient sync, clipping, AdamW, the
distributed optimizer), `state` (resume checkpoints), `pipeline_stages` (every stage returns the last one's answer;
1F1B), and GLM-5's `glm5`, `dsa` and `mtp`.
"""
from __future__ import annotations

import dataclasses
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from posttrain.chat import pad_id
from posttrain.config import MoEConfig
from posttrain.device import device as default_device
from posttrain.engines.base import one_by_one
from posttrain.engines.megatron import dsa, glm5, mtp, pipeline_stages
from posttrain.engines.megatron.forward import Forward
from posttrain.engines.megatron.layout import Parallel, bridge, check_layout, init_parallel, quiet, recompute_layers
from posttrain.engines.megatron.lm import LMLoss
from posttrain.engines.megatron.optimizer import Optimizer
from posttrain.engines.megatron.pipeline_stages import Pipeline, staged
from posttrain.engines.megatron.state import State
from posttrain.models.preset import check_folder, load_checkpoint, save_checkpoint


class MegatronTrainEngine:
    """A checkpoint as a Megatron GPTModel on this rank: `policy` (AdamW at `lr`), `critic` (a zero-initialised value
    head on the backbone's last hidden state) or `reference` (forward only). `fwd`: its forward (`forward.Forward`),
    for what looks inside the model (bench/megatron)."""

    def __init__(self, checkpoint: str | Path, role: str = "policy", *, lr: float | None = None,
                 parallel: Parallel = Parallel(), weight_decay: float = 0.0, seed: int = 0, recompute: bool = False,
                 moe=None, routing_replay: bool = False, distributed_optimizer: bool = False, micro_batches: int = 1,
                 train_indexers: tuple[str, int, float] | None = None, mtp_weight: float = 0.0):
        check_folder(checkpoint)
        hf_config = AutoConfig.from_pretrained(checkpoint)
        try:
            check_layout(hf_config, parallel)
            if hf_config.model_type in glm5.MODEL_TYPES:
                dsa.check(hf_config, parallel, recompute)
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
        self.glm5 = hf_config.model_type in glm5.MODEL_TYPES
        self._passthrough, sparse, indexers = {}, False, None
        self._draft_depth = mtp.depth(hf_config, checkpoint)
        if self.glm5:
            glm5.finish(self.gpt)
            sparse = glm5.sparse_layers(self.gpt)
            self._passthrough = glm5.passthrough(checkpoint, hf_config, indexers=not sparse)
        if train_indexers:  # (mode, kl_queries, kl_weight): the ramp's DSA adoption
            if not sparse:
                raise ValueError(f"ramp.attention dsa: {checkpoint} has no DSA indexer this engine runs (a GLM-5 "
                                 f"checkpoint on Megatron's local layers); use runtime.train_engine torch")
            indexers = dsa.train_indexers(self.gpt, hf_config, *train_indexers[:2])
        self.indexer_stats: dict[str, float] = {}
        if recompute and not torch.cuda.is_available():
            recompute_layers(self.gpt)
        self.vocab_size = hf_config.vocab_size
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        trains = lr is not None and role != "reference"
        self.fwd = Forward(self.gpt, self.pipe, parallel, hf_config, checkpoint, self.device, self.pad_id,
                           trains=trains, replay=routing_replay, sparse=sparse)
        self.fwd.dsa = indexers
        modules = {"gpt": self.gpt}
        # the checkpoint's draft layer, on the last pipeline stage, trained by sft's and the ramp's LM loss at
        # `mtp_weight`; an untied embedding's copy there (`mtp.embedding_copy`); `mtp_stats`: the last step's
        # MTP loss and first-step accuracy
        self.draft, self.mtp_stats = None, {}
        self._draft_copy = mtp.embedding_copy(self.gpt, self.pipe, self.tied) if self._draft_depth else None
        if self._draft_copy is not None:
            modules["draft_embedding"] = torch.nn.ParameterDict({"weight": self._draft_copy})
        if self._draft_depth and self.pipe.last:
            self.draft = mtp.Draft(mtp.Backbone(hf_config, self.device, self.vocab_size, self._draft_embedding,
                                                functools.partial(self.fwd.logits, whole=True)),
                                   checkpoint, self._draft_depth)
            modules["mtp"] = self.draft.module
        if role == "critic":
            self.value_head = torch.nn.Linear(hf_config.hidden_size, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)  # predicts 0 everywhere at first, as the torch critic
            torch.nn.init.zeros_(self.value_head.bias)
            modules["value_head"] = self.value_head
        self.model = torch.nn.ModuleDict(modules)
        self._optimizer = None
        if trains:
            self._optimizer = Optimizer(self.model, self.pipe, parallel, self.device, lr, weight_decay,
                                        distributed=distributed_optimizer, moe=self.glm5,
                                        embedding=self._shared_embedding())
        else:
            self.model.requires_grad_(False)
        self._state = State(self.model, self.gpt, self._optimizer, role, self.draft, self._draft_copy)
        # `routers` is the torch engine's hook object (aux loss, replay): Megatron's MoE layers route themselves here
        self.routers, self.moe_stats, self._hf = None, {}, None
        self.moe = moe or MoEConfig()
        self._balance = self.glm5 and moe is not None and trains
        # DeepSeek-V3's sequence-wise balance loss beside sft's and the ramp's LM loss (`glm5.SeqAux`)
        self._aux = glm5.SeqAux(glm5.n_routers(hf_config)) if self._balance and self.moe.aux_loss_weight else None
        if self._aux is not None:
            for _, router in glm5.moe_layers(self.gpt, hf_config):
                router.seq_aux = self._aux
        self._lm = LMLoss(self.fwd, micro_batches, draft=self.draft, depth=self._draft_depth, mtp_weight=mtp_weight,
                          aux=self._aux, aux_weight=self.moe.aux_loss_weight,
                          kl_weight=train_indexers[2] if train_indexers else 0.0)
        if routing_replay and not self.glm5:
            raise ValueError(f"rl.routing_replay: needs a mixture-of-experts policy; {checkpoint} is a dense "
                             f"{hf_config.model_type}")
        if routing_replay and recompute:  # a recomputed forward would route by itself
            raise ValueError("rl.routing_replay: not with megatron.recompute (the recomputed forward would not "
                             "replay the routes)")
        self.routing_replay = routing_replay
        self._folder: tempfile.TemporaryDirectory | None = None  # `for_lm`'s copy of a model it was handed
        self.eval()

    @classmethod
    def from_checkpoint(cls, path: str | Path, role: str = "policy", *, lr: float | None = None, moe=None,
                        routing_replay: bool = False, parallel: Parallel = Parallel(),
                        recompute: bool = False, distributed_optimizer: bool = False,
                        micro_batches: int = 1) -> MegatronTrainEngine:
        return cls(path, role, lr=lr, parallel=parallel, recompute=recompute, moe=moe, routing_replay=routing_replay,
                   distributed_optimizer=distributed_optimizer, micro_batches=micro_batches)

    @classmethod
    def for_lm(cls, model: torch.nn.Module | None, tok=None, checkpoint: str | Path | None = None, *, lr: float,
               weight_decay: float = 0.0, moe=None, mtp_weight: float = 0.0, dsa_weight: float = 0.0,
               indexers: tuple[str, int, float] | None = None, recompute: bool = False, cp: int | None = None,
               prepare: Callable | None = None, seed: int = 0, parallel: Parallel = Parallel(),
               distributed_optimizer: bool = False, micro_batches: int = 1) -> MegatronTrainEngine:
        """A policy on the LM loss of base, the ramp or sft (posttrain.engines.lm_engine), from `checkpoint`, which
        each rank reads its shards of, or else from `model`, saved with `tok` to a folder the engine keeps until
        `close`. `cp`: a ramp rung's context-parallel ranks (else `parallel`'s); `indexers`: (mode, kl_queries,
        kl_weight) while DSA's indexers train, the warm-up ("warmup") training nothing else, so the experts' bias and
        the draft layer stay. `dsa_weight` and `prepare` are the torch engine's: the indexers' KL weight is in
        `indexers` here, and the engine lays itself out over the ranks."""
        folder = None
        if checkpoint is None:
            folder = tempfile.TemporaryDirectory(prefix="posttrain-megatron-")
            save_checkpoint(model, tok, folder.name)  # as it is (a ramp rung's RoPE too)
            checkpoint = folder.name
        warmup = indexers is not None and indexers[0] == "warmup"
        try:
            engine = cls(checkpoint, lr=lr, parallel=dataclasses.replace(parallel, cp=cp) if cp else parallel,
                         weight_decay=weight_decay, seed=seed, recompute=recompute, moe=None if warmup else moe,
                         distributed_optimizer=distributed_optimizer, micro_batches=micro_batches,
                         train_indexers=indexers, mtp_weight=0.0 if warmup else mtp_weight)
        except BaseException:
            if folder is not None:
                folder.cleanup()
            raise
        engine._folder = folder
        return engine

    def _draft_embedding(self) -> torch.Tensor:
        """The word embedding the draft layer reads: the embedding on one stage; the last stage's copy with pipeline
        stages (tied: its output layer)."""
        return self._draft_copy if self._draft_copy is not None else self.gpt.shared_embedding_or_output_weight()

    def _shared_embedding(self) -> Callable[[], torch.Tensor] | None:
        """With pipeline stages, the weight on this stage that is one with its peer stage's (the first stage's
        embedding, the last stage's copy of it: its output layer when tied, else the draft layer's), whose gradient
        the optimizer sums over both; None where there is none."""
        if self.pipe.size == 1 or not (self.tied or self._draft_copy is not None or
                                       self._draft_depth and self.pipe.first):
            return None
        if self.tied or self.pipe.first:
            return self.gpt.shared_embedding_or_output_weight
        return lambda: self._draft_copy

    # --- the forward in the completion layout (RL, OPD, the critic) ---------------------------------------------------
    @staged
    def forward(self, samples) -> torch.Tensor:
        """An LM batch (a dict): its `lm_loss`. Samples: values [samples, longest] for a critic; for a policy the
        full logits [samples, longest, vocab] (gathered over tensor-parallel ranks: for inspection, the losses go
        through `logprobs`)."""
        if isinstance(samples, dict):
            return self.lm_loss(samples)
        if self.role == "critic":
            return self.fwd.values(samples, self.value_head)
        return self.fwd.full_logits(samples)

    @staged
    def logprobs(self, samples: list, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fwd.logprobs(samples, temperature)

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
        pipeline_stages.one_f_one_b(self.pipe, forward, len(parts))
        return tuple(t for i in range(len(parts)) for t in kept[i]) if self.pipe.last else None

    @staged
    def reverse_kl_loss(self, samples: list, teacher: list[torch.Tensor], temperature: float,
                        token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-vocabulary KL(policy || teacher) at the generated positions, vocab-parallel."""
        return self.fwd.reverse_kl(samples, teacher, temperature, token_weights)

    def replay_stats(self) -> dict[str, float]:
        """Routes replayed since the last call and the share the router would have chosen otherwise (every pipeline
        stage's routers); {} without replay or when none was replayed."""
        if not self.routing_replay:
            return {}
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        got = torch.tensor(glm5.take_replayed(self.gpt, self.hf_config), dtype=torch.float64)
        if self.pipe.size > 1:
            dist.all_reduce(got, group=ps.get_pipeline_model_parallel_group())
        n, differ = got.tolist()
        return {"routes_replayed": n, "routes_differ": differ / n} if n else {}

    # --- the LM loss (base, the ramp, sft) ----------------------------------------------------------------------------
    def lm_loss(self, batch: dict[str, torch.Tensor], total: torch.Tensor | None = None) -> torch.Tensor:
        """`posttrain.engines.lm.masked_lm_loss` on an LM batch (input_ids, loss_mask, optional position_ids and
        attention_mask), vocab-parallel, the whole batch's on every rank (`lm.LMLoss.loss`). `total`: the weight to
        divide by, its own by default."""
        return self._lm.loss(batch, total)

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """`lm_loss(batch)` times `scale`, backpropagated (one micro-batch of posttrain.train's loop), in
        `micro_batches` micro-batches of rows in the 1F1B order; its value."""
        return self._lm.forward_backward(batch, scale)

    # --- training -----------------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self.pipe.backward(loss)

    def step(self, max_grad_norm: float = 1.0) -> float:
        norm = self._optimizer.step(max_grad_norm)
        self.pipe.forget()
        if self._balance:
            self.moe_stats = glm5.balance_experts(self.gpt, self.hf_config, self.moe.bias_update_rate,
                                                  self.parallel.sequence_parallel, self.pipe.size, self.draft)
            self.moe_stats |= self._aux.pop(self.pipe.size) if self._aux else {}
        if self.fwd.dsa is not None:
            self.indexer_stats = dsa.pop_stats(self.fwd.dsa, self.pipe.size)
        if self._draft_depth:
            self.mtp_stats = mtp.pop_stats(self.draft, self.pipe)
        return norm.item()

    def step_stats(self) -> dict[str, float]:
        """The last step's expert load and balance loss, the indexers' KL and recall, the draft layer's loss and
        first-step accuracy, and the routes replayed since the last call (`replay_stats`); every rank calls it."""
        return dict(self.moe_stats) | self.indexer_stats | self.replay_stats() | self.mtp_stats

    def data_shard(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size)."""
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def with_schedule(self, schedule: Callable[[int], float], lr: float) -> MegatronTrainEngine:
        """`lr` times `schedule(step)` from now on (posttrain.train's warmup + cosine)."""
        self._optimizer.with_schedule(schedule, lr)
        return self

    def zero_grad(self) -> None:
        self.pipe.forget()
        if self._optimizer is not None:
            self.model.zero_grad(set_to_none=True)

    @property
    def opt(self) -> torch.optim.Optimizer | None:
        return self._optimizer.opt if self._optimizer else None

    @property
    def sched(self) -> torch.optim.lr_scheduler.LambdaLR | None:
        return self._optimizer.sched if self._optimizer else None

    @property
    def shards(self):
        """The distributed optimizer's split (`optimizer.Shards`), None without it."""
        return self._optimizer.shards if self._optimizer else None

    @property
    def lr(self) -> float:
        return self._optimizer.lr

    # --- weights and state --------------------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights under their Hugging Face names (gathered over tensor-parallel ranks; every rank
        returns them), on CPU for the rollout engines."""
        with torch.no_grad():  # mbridge broadcasts the parameters themselves over the pipeline group: not for autograd
            out = {name: t.detach().cpu().clone() for name, t in self.bridge.export_weights([self.gpt])}
        if self.glm5:  # one tensor per layer's experts, as transformers holds them
            out = glm5.to_transformers(out)
        out |= self._passthrough  # what no module here holds
        if self.tied and "lm_head.weight" not in out:  # transformers lists the tied head in its state dict
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        if self._draft_depth:  # under transformers' in-memory names (models.mtp's module), from the last stage
            out |= mtp.export(self.draft, self.pipe)
        return out

    def hf_model(self) -> torch.nn.Module:
        """The checkpoint's transformers model holding the current weights (loaded once, refreshed each call):
        what validation generates from and what the stage saves."""
        if self._hf is None:
            self._hf = load_checkpoint(self.checkpoint)[0].eval()
        self._hf.load_state_dict(self.weights())
        return self._hf

    def state_dict(self) -> dict:
        """This rank's shards, optimizer moments, schedule and RNG (each rank keeps its own)."""
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._state.load_state_dict(state)

    def save_sharded(self, folder: str | Path) -> None:
        """A Megatron distributed checkpoint (dist_checkpointing, torch_dist) of the policy in `folder`, loadable at
        another split (`state.State.save_sharded`). Every rank calls it (a collective)."""
        self._state.save_sharded(folder)

    def load_sharded(self, folder: str | Path) -> None:
        """`save_sharded`'s checkpoint into this engine, whatever split it was saved at (every rank calls it)."""
        self._state.load_sharded(folder)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def close(self) -> None:
        """The transformers copy `hf_model` keeps let go, and `for_lm`'s folder removed. The process groups are the
        process's, shared by every engine in it (`layout.init_parallel`): they outlive the engine."""
        self._hf = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
