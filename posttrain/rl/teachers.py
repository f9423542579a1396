"""Teachers for on-policy distillation: each holds one checkpoint and scores the student's own tokens.

A teacher gets token ids (never text) and hands back, for each generated token only, what the loss
needs: in the default sampled-token form one log-probability per token, so a few floats per token
cross the process boundary instead of a vocabulary-sized distribution. `top_k` and `full` return the
teacher's top-k (ids, log-probabilities) or its whole log-distribution per token.

Where Ray is up (the pipeline) a pool's teachers live by `placement`: `actor`, one Ray actor per teacher that every
rollout worker calls (large teachers, GPUs); `worker`, a copy of every teacher inside each rollout worker's own
process, which scores its samples itself (no Ray call and no transfer of the scores between processes: 13% more
OPD steps/s on 2 CPU cores, tiny model, 8.8-8.9 against 10.0-10.1, two runs each; each worker holds every teacher).
Without Ray they are in-process objects (library use, tests). Each scores through a rollout engine
(posttrain.engines: a prefill with logprobs, as SGLang would serve it).
"""
from __future__ import annotations

from typing import Literal

import ray
import torch

from posttrain.engines import rollout_engine
from posttrain.pipeline.raysupport import actor_options, wait_for_actors

Mode = Literal["sampled", "topk", "full"]


class Teacher:
    def __init__(self, checkpoint: str, threads: int = 1, engine: str = "torch"):
        if threads:  # 0: keep the process's (a teacher inside a rollout worker)
            torch.set_num_threads(threads)
        # its own engine, which scores as fast as it can (the torch engine: one row without padding)
        self.engine = rollout_engine(engine, checkpoint)

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        """Stop what the engine runs besides this process (an SGLang server)."""
        self.engine.close()

    def score(self, items: list[tuple[list[int], list[int], list[int]]], mode: Mode = "sampled",
              top_k: int = 16, temperature: float = 1.0) -> list:
        """items: (prompt ids, completion ids, generation mask). Per item, over its generated tokens in
        order: `sampled` a list of log p_teacher(token); `topk` (ids [n, k], logprobs [n, k]); `full` [n, V].
        The teacher's distribution is taken at the student's sampling temperature, as the student's is."""
        return self.engine.score(items, mode=mode, top_k=top_k, temperature=temperature)


class TeacherPool:
    """Named teachers and the routing of prompt domains to them (default: the teacher of the same name).
    Picklable, so the rollout workers call their teachers themselves: as Ray handles (`placement` actor), or,
    `worker`, as checkpoints that each unpickling process loads into its own teachers."""

    def __init__(self, checkpoints: dict[str, str], route: dict[str, str] | None = None, num_cpus: float = 0.2,
                 threads: int = 1, engine: str = "torch", placement: Literal["actor", "worker"] = "actor"):
        self.route, self.checkpoints, self.engine = dict(route or {}), dict(checkpoints), engine
        self.use_ray = ray.is_initialized() and placement == "actor"
        if self.use_ray:
            cls = ray.remote(Teacher).options(**actor_options(num_cpus=num_cpus, max_restarts=0))
            self.teachers = {d: cls.remote(c, threads, engine) for d, c in checkpoints.items()}
            wait_for_actors(list(self.teachers.values()), f"teacher(s) of {num_cpus} CPU",
                            "raise runtime.ray_num_cpus or lower opd.teacher_cpus")
        elif ray.is_initialized():
            self.teachers = {}  # loaded by each rollout worker that unpickles the pool (__setstate__)
        else:
            self.teachers = {d: Teacher(c, threads, engine) for d, c in checkpoints.items()}

    def __getstate__(self) -> dict:
        return self.__dict__ if self.use_ray else {**self.__dict__, "teachers": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not self.use_ray:  # in-process teachers at the process's own torch threads
            self.teachers = {d: Teacher(c, 0, self.engine) for d, c in self.checkpoints.items()}

    def teacher_of(self, domain: str):
        name = self.route.get(domain, domain)
        if name not in self.teachers:
            raise KeyError(f"no teacher for prompts of domain {domain!r} (routed to {name!r}; teachers: "
                           f"{sorted(self.teachers)})")
        return self.teachers[name]

    def score(self, batches: dict[str, list], mode: Mode = "sampled", top_k: int = 16,
              temperature: float = 1.0) -> dict[str, list]:
        """Score each domain's items with the teacher it is routed to; with Ray the teachers work concurrently
        (one batched call per teacher per request)."""
        if self.use_ray:
            refs = {d: self.teacher_of(d).score.remote(items, mode, top_k, temperature) for d, items in batches.items()}
            return {d: ray.get(r) for d, r in refs.items()}
        return {d: self.teacher_of(d).score(items, mode, top_k, temperature) for d, items in batches.items()}

    def close(self) -> None:
        if self.use_ray:
            try:  # the engines' servers stopped cleanly first; a stuck teacher is killed all the same
                ray.get([t.close.remote() for t in self.teachers.values()], timeout=60)
            except Exception:  # noqa: BLE001 (closing: any failure ends in the kill below)
                pass
            for t in self.teachers.values():
                ray.kill(t)
        else:
            for t in self.teachers.values():
                t.close()
