"""The RL loop's trained models over several ranks (megatron's tp x pp x cp x ep > 1): one Ray actor per rank, each
holding its shards of the policy (and critic and reference), every rank running each update on the same batch (SPMD),
rank 0 answering. The loop itself (rollouts, rewards, buffers, checkpoints) stays in the stage's process and drives the
ranks through the same four calls it makes on one rank's `Engines` (posttrain.rl.trainer): update, weights, save, load.

Ray Train's worker group fits a training function that runs to its end; the RL loop instead calls its trainer once
a step between rollouts, so the ranks are plain actors here with torch.distributed set up the way Ray Train does it:
rank 0's address and a free port on its node, then every rank joins at once."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import ray
import torch
from transformers import AutoTokenizer

from posttrain.device import device
from posttrain.models.preset import load_checkpoint
from posttrain.rl.trainer import local_engines


class _Rank:
    """One rank: torch.distributed joined, then the loop's Engines on this rank's shards."""

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, rank: int, world: int, addr: str, port: int, threads: int, build: dict) -> None:
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK="0")
        torch.set_num_threads(threads)
        self.engines = local_engines(**build)

    def update(self, *args) -> dict[str, float]:
        return self.engines.update(*args)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.engines.policy.weights()  # a collective: every rank calls it

    def state(self) -> dict:
        e = self.engines
        return {"policy": e.policy.state_dict(), "critic": e.critic.state_dict() if e.critic else None}

    def load(self, state: dict) -> None:
        if self.engines.critic is not None:
            self.engines.critic.load_state_dict(state["critic"])
        self.engines.policy.load_state_dict(state["policy"])


class _Policy:
    """What the loop reads of the policy besides its updates: the tokenizer, the gathered weights, and a transformers
    model holding them (validation generates from it; the stage saves it)."""

    def __init__(self, ranked: "RankedEngines", checkpoint: str):
        self.ranked, self.checkpoint, self._hf = ranked, checkpoint, None
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def weights(self) -> dict[str, torch.Tensor]:
        return ray.get([a.weights.remote() for a in self.ranked.actors])[0]

    def hf_model(self) -> torch.nn.Module:
        if self._hf is None:
            self._hf = load_checkpoint(self.checkpoint)[0].eval()
        self._hf.load_state_dict(self.weights())
        return self._hf

    def train(self) -> None:
        """A no-op: the ranks switch their own modes in each `update`."""

    eval = train


class RankedEngines:
    """`Engines` (posttrain.rl.loop) over `ranks` Ray actors; `build`: build_engines' keywords, the same on every
    rank. On CPU the ranks reserve no Ray CPU: the stage's task holds the trainer's share and idles while they
    compute (three specialists at once would otherwise wait on each other's reservations); on CUDA a GPU each."""

    def __init__(self, ranks: int, build: dict, threads: int = 1):
        if not ray.is_initialized():
            raise RuntimeError(f"runtime.train_engine {build['engine'][0]}: {ranks} ranks for the RL trainer need Ray "
                               f"(the pipeline's stages run on it)")
        gpu = device().type == "cuda"  # where the stage computes (runtime.device): its ranks compute there too
        actor = ray.remote(_Rank).options(num_cpus=0 if not gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0)
        self.actors = [actor.remote() for _ in range(ranks)]
        addr, port = ray.get(self.actors[0].address.remote())
        ray.get([a.start.remote(i, ranks, addr, port, threads, build) for i, a in enumerate(self.actors)])
        self.policy = _Policy(self, build["sft"])
        self.critic = self.ref = None  # on the ranks

    def update(self, r, batch: list, dbatch: list, distill) -> dict[str, float]:
        return ray.get([a.update.remote(r, batch, dbatch, distill) for a in self.actors])[0]

    def save(self, path: Path, st) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"ranks": ray.get([a.state.remote() for a in self.actors]), "state": st}, tmp)
        os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact

    def load(self, path: Path):
        ck = torch.load(path, weights_only=False)  # our own scratch file, written by save
        if len(ck.get("ranks", ())) != len(self.actors):
            raise ValueError(f"{path}: a checkpoint of {len(ck.get('ranks', ())) or 1} trainer rank(s), not "
                             f"{len(self.actors)}")
        ray.get([a.load.remote(s) for a, s in zip(self.actors, ck["ranks"])])
        return ck["state"]

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
