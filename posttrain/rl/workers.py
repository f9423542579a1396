"""Rollout workers for RL: each holds a copy of the policy in a rollout engine (posttrain.engines) and
turns tasks into samples tagged with the policy version that produced them; the trainer pushes weights
after each update.

Workers are Ray actors when Ray is up (the pipeline), else in-process threads (library use, tests):
both hand back `concurrent.futures.Future`s, so the trainer's loop is the same either way.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from environments.base import Task
from posttrain.chat import ChatFormatError, chat_format
from posttrain.engines import RolloutEngine, registry, rollout_engine
from posttrain.engines.base import WeightSource
from posttrain.engines.weight_group import send, weight_group
from posttrain.judge import ModelJudge
from posttrain.pipeline.raysupport import actor_options, wait_for_actors
from posttrain.rl.rollout import run_episodes


@dataclass
class Sample:
    """One finished episode exactly as generated: token ids and behaviour logprobs, never re-tokenised."""
    task_id: str
    group: int                 # samples of the same prompt in the same request share a group
    prompt_ids: list[int]
    ids: list[int]             # everything after the prompt (generated tokens and tool outputs)
    gen_mask: list[int]        # 1 where the policy generated the token
    logprobs: list[float]      # behaviour logprobs (0 on tool tokens)
    reward: float
    version: int               # policy version (number of updates) that generated it: its oldest token's
    blocked: list[dict] = field(default_factory=list)  # hack attempts the sandbox's guard stopped
    domain: str = ""
    teacher: Any = None        # distillation samples: the teacher's scores of the generated tokens
    subtrace: int = 0          # its place among the episode's compacted sub-traces (0: the first or only one)
    truncated: bool = False    # the episode ended at the context budget (compaction off)
    routes: Any = None         # the rollout's experts per position (rl.routing_replay; posttrain.routing_replay)
    versions: list[int] | None = None  # rl.partial_rollouts: each of ids' version (-1: not generated)

    @property
    def n_generated(self) -> int:
        return sum(self.gen_mask)


def samples_of(episodes: list, group_size: int, n_rl: int, version: int) -> list[Sample]:
    """Samples of finished episodes: the first `n_rl` in groups of `group_size`, the rest one group each. A
    compacted episode gives one sample per sub-trace, each with the episode's reward (critic PPO only: the
    config refuses compaction for GRPO); its blocked calls are counted once, on the first. `version`: the
    engine's, for traces whose tokens carry none of their own."""
    def oldest(t) -> int:
        return min((v for v in t.versions if v >= 0), default=version) if t.versions else version
    return [Sample(e.task.id, i // group_size if i < n_rl else n_rl // group_size + i - n_rl, t.prompt_ids, t.ids,
                   t.gen_mask, t.logprobs, e.reward, oldest(t), e.blocked if j == 0 else [], e.task.domain,
                   subtrace=j, truncated=e.truncated, routes=t.routes, versions=t.versions)
            for i, e in enumerate(episodes) for j, t in enumerate(e.traces())]


def check_stops(episodes: list, tok, max_new_tokens: int) -> None:
    """A batch in which no turn of any episode ended on a stop id means the checkpoint never emits one of the ids
    the chat layer stops on (a template or generation_config mismatch): every reward would be judged on text cut
    at the budget, so the stage stops instead of training on it."""
    if episodes and not any(e.stopped_turns for e in episodes):
        fmt = chat_format(tok)
        stops = ", ".join(f"{i} {tok.convert_ids_to_tokens(i)!r}" for i in fmt.stop_ids)
        raise ChatFormatError(
            f"rollouts: none of {len(episodes)} episodes ended a turn on a stop id within {max_new_tokens} new "
            f"tokens (template {fmt.template}, stop ids {stops}): the checkpoint does not emit the ids its chat "
            f"template ends a turn with, or rl.max_new_tokens is too small for it. Set eos_token_id in the "
            f"checkpoint's generation_config.json, or rl.stop_check: false for an untrained model")


UPDATE_WAIT_S = 600.0  # how long a rollout waits for the weights pushed before it (partial rollouts)


class RolloutWorker:
    """`partial`: updates reach the generations in flight (rl.partial_rollouts), so `set_weights` runs beside
    `rollout` (its own thread) and each rollout first waits for the weights pushed before it was submitted."""

    def __init__(self, checkpoint: str, threads: int = 1, teachers=None, engine: str = "torch",
                 record_routes: bool = False, partial: bool = False, dtype: str = "float32"):
        torch.set_num_threads(threads)
        self.engine: RolloutEngine = rollout_engine(engine, checkpoint, dtype, keep_in_flight=partial)
        if record_routes:  # routing replay: the samples carry the experts that produced them
            if not registry.supports("rollout", engine, registry.ROUTING_RECORD):
                raise ValueError(f"rl.routing_replay: the {engine!r} rollout engine does not record expert routes "
                                 f"(engines that do: {registry.names('rollout', registry.ROUTING_RECORD)})")
            self.engine.record_routes()  # what ROUTING_RECORD declares (posttrain.engines.registry)
        self._updated = threading.Condition()
        self._update_error: BaseException | None = None
        self.landed = 0  # the newest version whose update completed (a restarted server may hold an older one)
        self.tok = self.engine.tokenizer
        self.teachers = teachers  # a TeacherPool: distillation samples are scored here, off the trainer
        self.judge: ModelJudge | None = None  # the guard's model judge, loaded by the first rollout that names it

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        """Stop what the engine runs besides this process (an SGLang server)."""
        self.engine.close()

    def _judge(self, spec: tuple | None):
        if spec is None:
            return None
        if self.judge is None or (self.judge.checkpoint, self.judge.features) != spec:
            self.judge = ModelJudge(spec[0], tuple(spec[1]))
        return self.judge

    @property
    def version(self) -> int:
        return self.engine.version

    def set_weights(self, source: WeightSource, version: int) -> None:
        if version >= self.landed:  # else a later push landed first (a threaded Ray actor may reorder calls)
            self._land(version, lambda: self.engine.update_weights(source, version))

    # runtime.weight_sync broadcast: the trainer's rank 0 sends to every worker's SGLang server in one group (the
    # engines that declare WEIGHT_BROADCAST in posttrain.engines.registry have these three)
    def in_weight_group(self) -> bool:
        return self.engine.in_group()

    def join_weight_group(self, payload: dict) -> dict:
        return self.engine.join_group(payload)

    def receive_weights(self, payload: dict, version: int) -> dict:
        return self._land(version, lambda: self.engine.receive_weights(payload, version))

    def _land(self, version: int, update):
        """Run an update of the weights to `version`; rollouts waiting for it go on once it landed, and raise if it
        failed (the trainer does not wait on a push)."""
        try:
            out = update()
        except BaseException as e:
            self._update_error = e
            raise
        finally:
            with self._updated:
                if self._update_error is None:
                    self.landed = max(self.landed, version)
                self._updated.notify_all()
        return out

    def _wait_for(self, version: int) -> None:
        with self._updated:
            self._updated.wait_for(lambda: self.landed >= version or self._update_error, UPDATE_WAIT_S)
        if self._update_error is not None:  # its weights are behind the trainer's for good: say so, loudly
            raise RuntimeError(f"rollout worker: a weight update failed: {self._update_error}") \
                from self._update_error
        if self.landed < version:
            raise RuntimeError(f"rollout worker: the weights of version {version} did not arrive within "
                               f"{UPDATE_WAIT_S:.0f} s (it holds version {self.engine.version})")

    def rollout(self, tasks: list[Task], group_size: int, seed: int, distill: tuple[Task, ...] = (),
                teacher_mode: str = "sampled", top_k: int = 16, judge: tuple | None = None,
                stop_check: bool = False, min_version: int = 0, **kw) -> tuple[list[Sample], dict]:
        """`group_size` samples of each task, then one of each `distill` task scored by its domain's teacher
        (those come back with `teacher` set); the sampling stream is a pure function of `seed`. `judge`:
        (checkpoint, features) of the guard's model judge, loaded once per worker; `stop_check`: a batch that
        never stops is an error (check_stops); `min_version`: wait for the weights of that version first."""
        self._wait_for(min_version)
        t0 = time.perf_counter()
        spec0 = dict(self.engine.stats)
        gen = torch.Generator().manual_seed(seed)
        todo = [t for t in tasks for _ in range(group_size)] + list(distill)
        j = self._judge(judge)
        j0 = j.tokens if j else 0
        eps = run_episodes(self.engine, self.tok, todo, generator=gen, batch_size=len(todo), judge=j, **kw)
        if stop_check:
            check_stops(eps, self.tok, kw.get("max_new_tokens", 48))
        n_rl = len(tasks) * group_size
        out = samples_of(eps, group_size, n_rl, self.version)
        info = {"seconds": time.perf_counter() - t0, "tokens": sum(s.n_generated for s in out),
                "episodes": len(eps), "judge_tokens": (j.tokens - j0) if j else 0,
                **{k: v - spec0.get(k, 0) for k, v in self.engine.stats.items()}}  # MTP drafts
        if distill:
            by_domain: dict[str, list[Sample]] = {}
            for s in (s for s in out if s.group >= len(tasks)):  # the distillation episodes' sub-traces
                by_domain.setdefault(s.domain, []).append(s)
            scores = self.teachers.score({d: [(s.prompt_ids, s.ids, s.gen_mask) for s in ss]
                                          for d, ss in by_domain.items()}, teacher_mode, top_k,
                                         kw.get("temperature", 1.0))
            for d, ss in by_domain.items():
                for s, t in zip(ss, scores[d]):
                    s.teacher = t
        return out, info


class WorkerPool:
    """n rollout workers; calls on one worker run in submission order (weights, then rollouts), or with `partial`,
    weights beside the rollouts (in their own order) while each rollout waits for the weights pushed before it.
    `weight_sync`: how pushed weights travel: `store` (a copy in Ray's object store each worker loads into its
    engine) or `broadcast` (this process, the trainer, broadcasts them to every worker's SGLang server in one
    process group: NCCL on GPU, gloo on CPU); `dtype`: what the workers' engines generate in."""

    def __init__(self, checkpoint: str, n: int, num_cpus: float, threads: int = 1, teachers=None,
                 engine: str = "torch", record_routes: bool = False, partial: bool = False,
                 weight_sync: str = "store", dtype: str = "float32"):
        if weight_sync == "broadcast" and not registry.supports("rollout", engine, registry.WEIGHT_BROADCAST):
            raise ValueError(f"runtime.weight_sync broadcast: the {engine!r} rollout engine cannot join the trainer's "
                             f"process group (runtime.rollout_engine: one of "
                             f"{registry.names('rollout', registry.WEIGHT_BROADCAST)})")
        self.use_ray, self.partial, self.version = ray.is_initialized(), partial, 0
        self.broadcast, self.group = weight_sync == "broadcast", None
        args = (checkpoint, threads, teachers, engine, record_routes, partial, dtype)
        if self.use_ray:
            # partial: set_weights in a group of its own (one thread, calls in order) beside the rollouts
            cls = (ray.remote(concurrency_groups={"weights": 1})(RolloutWorker) if partial else
                   ray.remote(RolloutWorker)).options(**actor_options(num_cpus=num_cpus, max_restarts=0))
            self.workers = [cls.remote(*args) for _ in range(n)]
            wait_for_actors(self.workers, f"rollout worker(s) of {num_cpus} CPU",
                            "raise runtime.ray_num_cpus or lower rl.worker_cpus / rl.rollout_workers")
        else:
            self.workers = [RolloutWorker(*args) for _ in range(n)]
            self.pools = [ThreadPoolExecutor(1) for _ in range(n)]
            self.weight_pools = [ThreadPoolExecutor(1) for _ in range(n)] if partial else self.pools

    def __len__(self) -> int:
        return len(self.workers)

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """New weights to every worker; rollouts submitted after this call use them. A broadcast returns once every
        server has them: without `partial`, after each server's running requests finished."""
        self.version = version
        if self.broadcast:
            return self._broadcast(state_dict, version)
        if self.use_ray:
            ref = ray.put(state_dict)  # a copy: the trainer's next update does not reach it
            for w in self.workers:
                (w.set_weights.options(concurrency_group="weights") if self.partial else w.set_weights).remote(
                    ref, version)
        else:  # threads share memory: snapshot the weights before the trainer changes them in place
            sd = {k: v.detach().clone() for k, v in state_dict.items()}
            for w, p in zip(self.workers, self.weight_pools):
                p.submit(w.set_weights, sd, version)

    def _weights_call(self, i: int, method: str, *args):
        """A call on worker i's weights channel (its own thread with `partial`), waited for."""
        w = self.workers[i]
        if self.use_ray:
            f = getattr(w, method)
            return ray.get((f.options(concurrency_group="weights") if self.partial else f).remote(*args))
        return self.weight_pools[i].submit(getattr(w, method), *args).result()

    def _broadcast(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        n = len(self.workers)
        # a group with every server, built again when one of them restarted since (it left the group with its process)
        if self.group is None or not all(self._weights_call(i, "in_weight_group") for i in range(n)):
            address = "127.0.0.1"
            if self.use_ray:
                address = ray.util.get_node_ip_address()
            self.group = weight_group([lambda p, i=i: self._weights_call(i, "join_weight_group", p) for i in range(n)],
                                      address)
        send(self.group, state_dict, [lambda p, i=i: self._weights_call(i, "receive_weights", p, version)
                                      for i in range(n)])

    def submit(self, i: int, *args, **kw) -> Future:
        if self.partial:
            kw["min_version"] = self.version
        if self.use_ray:
            return self.workers[i].rollout.remote(*args, **kw).future()
        return self.pools[i].submit(self.workers[i].rollout, *args, **kw)

    def close(self) -> None:
        if self.use_ray:
            try:  # a weight update under way finishes first (partial: on its own thread), then the servers stop
                if self.partial:
                    ray.get([w.ready.options(concurrency_group="weights").remote() for w in self.workers], timeout=60)
                ray.get([w.close.remote() for w in self.workers], timeout=60)
            except Exception:  # noqa: BLE001 (closing: any failure ends in the kill below)
                pass
            for w in self.workers:
                ray.kill(w)
        else:
            for p in {*self.pools, *self.weight_pools}:
                p.shutdown(wait=True)
            for w in self.workers:
                w.close()


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    """The samples by their group (a prompt's rollouts), in the order the groups first appear."""
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s)
    return list(by_group.values())


class RolloutBuffer:
    """Finished groups waiting for the trainer, oldest first; too-stale groups are dropped and counted."""

    def __init__(self, max_staleness: int, groups: list[list[Sample]] | None = None):
        self.k = max_staleness
        self.groups: list[list[Sample]] = list(groups or [])
        self.dropped = 0            # samples dropped for staleness, over the run
        self.staleness = Counter()  # staleness of every sample trained on, over the run

    def add(self, samples: list[Sample]) -> None:
        self.groups += groups_of(samples)

    def drop_stale(self, version: int) -> int:
        keep = [g for g in self.groups if version - min(s.version for s in g) <= self.k]
        n = sum(len(g) for g in self.groups) - sum(len(g) for g in keep)
        self.groups, self.dropped = keep, self.dropped + n
        return n

    def take(self, n_groups: int, version: int) -> list[Sample]:
        """The `n_groups` oldest fresh groups, flattened; their staleness is recorded."""
        self.drop_stale(version)
        batch, self.groups = self.groups[:n_groups], self.groups[n_groups:]
        out = [s for g in batch for s in g]
        self.staleness.update(version - s.version for s in out)
        return out

    def __len__(self) -> int:
        return len(self.groups)
