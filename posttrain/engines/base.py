"""The two engine interfaces every stage trains and generates through (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Protocol

import torch

StopReason = Literal["stop", "length"]
WeightSource = Mapping[str, torch.Tensor] | str | Path  # a state dict, or a checkpoint folder


@dataclass
class Generation:
    """One prompt's completion exactly as sampled: token in, token out, never re-tokenised."""
    ids: list[int]
    logprobs: list[float]      # behaviour log-probability of each token, at the sampling temperature
    stop_reason: StopReason    # "stop": ended on a stop id (kept as the last id); "length": max_new_tokens
    # the experts each position of prompt + ids ran through, [routers, positions, k] (posttrain.routing_replay);
    # None unless the engine records them
    routes: torch.Tensor | None = None
    # the weight version that produced each of `ids` where an update can land mid-generation (an SGLang engine
    # keeping generations in flight); None: all of them came from the engine's `version`
    versions: list[int] | None = None


class RolloutEngine(Protocol):
    """Generation for rollouts, teachers and evaluation."""
    tokenizer: Any
    version: int               # policy version (trainer updates) of the weights it holds
    stats: dict[str, float]    # counters since it was built (speculative decoding's drafted and accepted tokens)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, stop_ids: set[int],
                 generator: torch.Generator | None = None) -> list[Generation]:
        """Complete each prompt (token ids); temperature 0 is greedy."""

    def score(self, items: list[tuple[list[int], list[int], list[int]]], *, mode: str = "sampled", top_k: int = 16,
              temperature: float = 1.0) -> list:
        """For (prompt ids, completion ids, generation mask) items, the engine's log-probabilities of the
        generated tokens (`sampled`), its top-k (ids, logprobs) (`topk`) or whole log-distribution (`full`)."""

    def update_weights(self, source: WeightSource, version: int) -> None:
        """Take new weights; generations started after this call use them."""

    def pause(self) -> None:
        """Hold new generations (a weight update in progress)."""

    def resume(self) -> None: ...

    def close(self) -> None:
        """Release what outlives garbage collection (a server process); a no-op for an engine in this process."""


class TrainEngine(Protocol):
    """A model being trained: forward in the completion layout, backward, optimizer step, state."""
    model: torch.nn.Module
    device: torch.device
    tokenizer: Any

    def forward(self, samples: list) -> torch.Tensor:
        """The model's output at the position predicting each completion token ([samples, longest, ...]):
        logits for a policy, values for a critic (posttrain.models.prefix's completion layout)."""

    def logprobs(self, samples: list, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A policy's (log-probability, entropy) of each completion token at `temperature`, [samples, longest]:
        what the policy losses need, without the [tokens, vocab] logits where the engine can avoid them."""

    def logprob_loss(self, samples: list, temperature: float, loss_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss_of(logp, ent), logp, ent detached) with `logprobs`' [samples, longest] tensors, for a loss that is a
        sum of per-token terms: an engine may differentiate it chunk by chunk and make its gradient in the forward
        (the fused head kernels do), so `loss_of` must not couple tokens."""

    def reverse_kl_loss(self, samples: list, teacher: list[torch.Tensor], temperature: float,
                        token_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of `token_weights` [samples, longest] times the full-vocabulary KL(policy || teacher) at each generated
        position, that KL detached, 0 elsewhere); `teacher[i]`: the teacher's log-probabilities at sample i's generated
        positions, [generated, vocab]. A sum of per-token terms, so an engine may make its gradient in the forward (the
        fused head kernels do)."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def logprob_losses(self, parts: list[tuple[list, Any]], temperature: float
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`logprob_loss` of each (samples, loss_of) micro-batch, each backpropagated: [(loss detached, logp,
        ent)]. An engine may interleave them (megatron: the 1F1B order over pipeline stages)."""

    def forward_backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """An LM batch's loss times `scale`, backpropagated; its value (posttrain.train's loop, one micro-batch).
        An engine may split it into micro-batches of its own (megatron: the 1F1B pipeline schedule)."""

    def step(self, max_grad_norm: float = 1.0) -> float:
        """Clip, optimizer step, zero the gradients; returns the gradient norm before clipping."""

    def zero_grad(self) -> None: ...

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights for rollout engines (`RolloutEngine.update_weights`)."""

    def state_dict(self) -> dict:
        """Weights, optimizer state and RNG: everything an exact resume needs."""

    def load_state_dict(self, state: dict) -> None: ...

    def train(self) -> None: ...

    def eval(self) -> None: ...

    # the LM loss of base, the ramp and sft (posttrain.train's loop)
    lr: float                  # the learning rate of the last step

    def with_schedule(self, schedule: Callable[[int], float], lr: float) -> "TrainEngine":
        """This engine stepping at `lr * schedule(step)`."""

    def lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """An LM batch's masked loss, no gradient (validation)."""

    def data_shard(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): which share of a global batch it trains on."""

    def step_stats(self) -> dict[str, float]:
        """The last optimizer step's figures beyond the loss: expert load (posttrain.models.moe), routes replayed since
        the last call, the DSA indexers' KL and recall, the draft (MTP) layer's loss and accuracy; {} where none."""

    def hf_model(self) -> torch.nn.Module:
        """The trained weights as a Hugging Face model (a collective over the ranks that hold shards of it)."""

    def close(self) -> None:
        """Release what the engine holds beyond garbage collection (process groups, ranks); may be a no-op."""


Forward = Callable[[torch.nn.Module, list], torch.Tensor]


def one_by_one(engine: TrainEngine, parts: list[tuple[list, Any]], temperature: float
               ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`TrainEngine.logprob_losses` one micro-batch after the other: each forward, then its backward."""
    out = []
    for samples, loss_of in parts:
        loss, logp, ent = engine.logprob_loss(samples, temperature, loss_of)
        engine.backward(loss)
        out.append((loss.detach(), logp, ent))
    return out
