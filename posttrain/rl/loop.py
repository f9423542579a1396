"""The RL loop shared by the specialists, OPD and the cross-stage chains. Rollout workers generate while the
trainer trains (asynchronous, with a staleness bound k; k = 0 is synchronous on-policy), GRPO or critic PPO,
the domain's verifier as reward.

Token in, token out: the trainer consumes the exact token ids and behaviour logprobs the workers
produced; nothing is decoded and re-encoded on the way, so the importance ratio measures only the
policy change. Every `checkpoint_every` steps the full state (weights, optimizers, RNG, request cursor,
rollout buffer, curves) goes to the scratch dir; a rerun after a crash continues from it exactly.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from environments.base import Task
from posttrain.config import MoEConfig, RLConfig
from posttrain.engines import as_rollout_engine
from posttrain.models.preset import seed_all
from posttrain.pipeline.store import checkpointed
from posttrain.rl import alarms
from posttrain.rl.ranks import RankedEngines
from posttrain.rl.rollout import run_episodes
from posttrain.rl.teachers import TeacherPool
from posttrain.rl.trainer import Engines, local_engines
from posttrain.rl.workers import RolloutBuffer, Sample, WorkerPool, groups_of

COUNTS = ("verifications", "accepted", "judge_tokens", "episodes")  # summed over a step's rollout requests


FULL_VOCAB_WARN = 32768


def warn_full_at_large_vocab(teachers: dict[str, str]) -> str | None:
    """The `full` form ships each scored token's whole teacher distribution ([tokens, vocab] fp32) from the
    teacher to the trainer: at 151,936 tokens that is 622 MB for 16 samples of 64 tokens (an H200, bench/cuda_shapes),
    where `sampled` ships one float a token. Not an error (it is the exact reverse KL), but worth saying before
    a long run; returns the warning printed, if any."""
    vocabs = {}
    for name, ck in teachers.items():
        cfg = Path(ck) / "config.json"
        if cfg.is_file():
            vocabs[name] = json.loads(cfg.read_text()).get("vocab_size", 0)
    big = {n: v for n, v in vocabs.items() if v >= FULL_VOCAB_WARN}
    if not big:
        return None
    v = max(big.values())
    msg = (f"[opd] loss=full at a {v:,}-token vocabulary (teachers {', '.join(sorted(big))}): every scored token "
           f"carries {4 * v / 2**20:.1f} MiB of teacher log-probabilities to the trainer; `sampled` (one float a "
           f"token) or `topk` cost a fraction of that")
    print(msg, flush=True)
    return msg


@dataclass
class Distill:
    """On-policy distillation in the same loop: the student samples prompts of the teachers' domains and
    each prompt's teacher scores its tokens (alone: multi-teacher OPD; beside RL: cross-stage distillation)."""
    teachers: dict[str, str]             # teacher name -> checkpoint dir
    pool: list[Task]                     # prompts, drawn evenly across their domains
    prompts_per_step: int
    route: dict[str, str] = field(default_factory=dict)  # prompt domain -> teacher name (default: same name)
    mode: str = "sampled"                # sampled | topk | full (see posttrain/rl/opd_loss.py)
    top_k: int = 16
    coef: float = 1.0
    reward_weight: float = 0.0           # mix the task reward in as a sequence advantage
    kl_coef: float = 0.0                 # KL(student || the loop's reference) on the distilled tokens (sampled only)
    teacher_cpus: float = 0.2
    teacher_placement: str = "actor"     # Ray actors, or inside each rollout worker (posttrain.rl.teachers)

    def __post_init__(self) -> None:
        if self.kl_coef and self.mode != "sampled":
            raise ValueError(f"a reference KL in distillation needs the sampled loss, not {self.mode!r}")
        if self.mode == "full":
            warn_full_at_large_vocab(self.teachers)

    def domains(self) -> list[str]:
        return sorted({t.domain for t in self.pool})

    def draw(self, rng: random.Random, n: int, request: int) -> list[Task]:
        """n prompts split evenly over the domains (the remainder rotates with the request index)."""
        ds = self.domains()
        out = []
        for i, d in enumerate(ds):
            k = n // len(ds) + ((i - request) % len(ds) < n % len(ds))
            out += rng.sample([t for t in self.pool if t.domain == d], k)
        return out


@dataclass
class State:
    """Everything a resumed run needs besides the weights and optimizers."""
    step: int = 0
    next_request: int = 0
    groups: list[list[Sample]] = field(default_factory=list)  # the rollout buffer
    distill_groups: list[list[Sample]] = field(default_factory=list)
    dropped: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    history: dict[str, list] = field(default_factory=dict)
    attempts: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    alarms: list[dict] = field(default_factory=list)  # reward-hacking alarms raised (posttrain.rl.alarms)
    kept: tuple[int, float] | None = None  # rl.keep best: the best-validated step so far and its score


def build_engines(r: RLConfig, sft: str, with_critic: bool, rl: bool = True, moe: MoEConfig | None = None,
                  engine: tuple[str, dict] = ("torch", {})) -> Engines | RankedEngines:
    """The loop's trained models: `Engines` in this process (posttrain.rl.trainer), or over the several ranks an
    engine's `parallel` option splits the model over (megatron's tp x pp x cp x ep > 1) the same calls on Ray actors
    (posttrain.rl.ranks). `rl`: the loop trains on rollouts (not distillation only), so
    the KL alarm has tokens to watch; `moe`: how a policy with routers balances them; `engine`: the train engine's
    name and options (posttrain.engines)."""
    parallel = engine[1].get("parallel")
    if parallel is not None and parallel.model_ranks > 1:
        return RankedEngines(parallel.model_ranks, dict(r=r, sft=sft, with_critic=with_critic, rl=rl, moe=moe,
                                                        engine=engine), threads=torch.get_num_threads())
    return local_engines(r, sft, with_critic, rl, moe, engine)


def val_scores(policy, tok, val: list[Task], **kw) -> dict[str, float]:
    """Greedy validation accuracy per domain of `val`, and "all" over every task."""
    eps = run_episodes(policy, tok, val, temperature=0.0, **kw)
    out: dict[str, list[float]] = {"all": []}
    for e in eps:
        out["all"].append(e.reward)
        out.setdefault(e.task.domain, []).append(e.reward)
    return {d: sum(v) / max(1, len(v)) for d, v in out.items()}


class Feed:
    """Rollout requests in flight on the workers and the buffers they fill: RL groups and distillation
    samples. A request's prompts and sampling stream are pure functions of its index, so a resumed run
    redraws none."""

    def __init__(self, r: RLConfig, pool: list[Task], distill: Distill | None, workers: WorkerPool, seed: int,
                 st: State, kw: dict):
        self.r, self.pool, self.distill, self.workers, self.seed, self.st = r, pool, distill, workers, seed, st
        self.kw = kw
        self.counts = dict.fromkeys(COUNTS, 0)  # this step's rollouts: MTP drafting, judge (collect)
        self.n_rl = r.prompts_per_step if pool else 0
        self.n_distill = distill.prompts_per_step if distill else 0
        self.rl_req, self.d_req = (math.ceil(n / r.rollout_workers) for n in (self.n_rl, self.n_distill))
        self.buffer = RolloutBuffer(r.max_staleness, st.groups)
        self.buffer.dropped, self.buffer.staleness = st.dropped, Counter(st.staleness)
        self.dbuffer = RolloutBuffer(r.max_staleness, st.distill_groups)
        self.inflight: deque[tuple[int, Future]] = deque()  # (worker, its result), oldest first
        # rl.dynamic_sampling: this step's groups whose rewards all agree, set aside, and the RL groups it drew
        self.uniform: list[list[Sample]] = []
        self.drawn = 0

    def _submit(self) -> None:
        st, d = self.st, self.distill
        rng = random.Random(self.seed * 1_000_003 + st.next_request)
        tasks = rng.sample(self.pool, self.rl_req) if self.rl_req else []
        dtasks = d.draw(rng, self.d_req, st.next_request) if self.d_req else []
        extra = {"distill": tuple(dtasks), "teacher_mode": d.mode, "top_k": d.top_k} if self.d_req else {}
        # the least-loaded worker (fewest unfinished requests; ties rotate), so a worker held up by long episodes
        # gets fewer: the samples are the same whichever worker draws them
        n = len(self.workers)
        load = Counter(i for i, f in self.inflight if not f.done())
        worker = min(range(n), key=lambda i: (load[i], (i - st.next_request) % n))
        self.inflight.append((worker, self.workers.submit(worker, tasks, self.r.group_size, rng.getrandbits(31),
                                                          temperature=self.r.temperature, **extra, **self.kw)))
        st.next_request += 1

    def _have(self) -> int:
        return len(self.buffer) if self.n_rl else len(self.dbuffer)

    def top_up(self) -> None:
        """k + 1 steps' worth outstanding: with k = 0 nothing is generated before the weights it must use."""
        per, need = (self.rl_req, self.n_rl) if self.n_rl else (self.d_req, self.n_distill)
        while self._have() + len(self.inflight) * per < (self.r.max_staleness + 1) * need:
            self._submit()

    def _add(self, samples: list[Sample]) -> None:
        groups = groups_of([s for s in samples if s.teacher is None])
        self.drawn += len(groups)
        for g in groups:
            uniform = self.r.dynamic_sampling and len({s.reward for s in g}) == 1
            (self.uniform.append if uniform else self.buffer.groups.append)(g)
        self.dbuffer.add([s for s in samples if s.teacher is not None])

    def _capped(self) -> bool:
        """rl.dynamic_sampling's cap: the step drew its limit of groups."""
        return bool(self.r.dynamic_sampling) and self.drawn >= self.r.dynamic_sampling * self.n_rl

    def _fill_at_cap(self) -> bool:
        """At the cap the set-aside groups fill the step's batch."""
        if self._capped():
            self.buffer.groups += self.uniform[:max(0, self.n_rl - len(self.buffer))]
        return self._capped()

    def collect(self, step: int) -> tuple[list[Sample], list[Sample], float, float]:
        """The step's RL and distillation batches (fresh enough for `step`), and the generation seconds and
        tokens of the rollouts that arrived meanwhile."""
        self.top_up()
        gen_s = gen_tok = 0.0
        self.counts = dict.fromkeys(COUNTS, 0)
        self.uniform, self.drawn = [], 0
        while True:
            self.buffer.drop_stale(step)
            self.dbuffer.drop_stale(step)
            if (len(self.buffer) >= self.n_rl or self._fill_at_cap()) and len(self.dbuffer) >= self.n_distill:
                break
            samples, info = self.inflight.popleft()[1].result()
            self._add(samples)
            gen_s, gen_tok = gen_s + info["seconds"], gen_tok + info["tokens"]
            for k in self.counts:
                self.counts[k] += info.get(k, 0)
            if not self._capped():  # at the cap nothing more is drawn for this step
                self.top_up()
        return (self.buffer.take(self.n_rl, step) if self.n_rl else [],
                self.dbuffer.take(self.n_distill, step) if self.n_distill else [], gen_s, gen_tok)

    def snapshot(self, step: int, hist: dict, attempts: list, wall_s: float, drain: bool,
                 alarms: list[dict], kept: tuple[int, float] | None) -> State:
        """The loop's state after `step` steps; `drain` first waits for the rollouts in flight (they are part
        of a resumable state: the buffers are saved whole)."""
        while drain and self.inflight:
            self._add(self.inflight.popleft()[1].result()[0])
        b, d = self.buffer, self.dbuffer
        return State(step, self.st.next_request, b.groups if drain else [], d.groups if drain else [],
                     b.dropped + d.dropped, dict(b.staleness + d.staleness), hist, attempts, wall_s, alarms, kept)

    def close(self) -> None:
        for _, f in self.inflight:
            f.cancel()


def mean_step_times(hist: dict) -> dict[str, float]:
    """Seconds per step, over a run's history: waiting for rollouts, in the update, pushing the weights."""
    return {k: sum(hist[k]) / len(hist[k]) for k in ("rollout_wait_s", "train_s", "push_s")}


def history_row(batch: list[Sample], dbatch: list[Sample], stats: dict, feed: Feed, hist: dict, step: int,
                gen_s: float, gen_tok: float, times: dict[str, float], wall_s: float) -> dict[str, float]:
    """One step's curves: reward, the update's statistics, staleness, tokens, throughput, and where the trainer's
    time went (`times`: seconds waiting for rollouts, in the update, pushing the weights)."""
    both = batch + dbatch
    rewards = torch.tensor([s.reward for s in batch or dbatch if s.subtrace == 0])  # one per episode
    prev = {k: hist[k][-1] if hist.get(k) else 0.0 for k in ("student_tokens", "teacher_tokens")}
    row = {"reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
           **stats, "staleness_mean": sum(step - s.version for s in both) / len(both),
           "stale_dropped": float(feed.buffer.dropped + feed.dbuffer.dropped),
           "blocked": float(sum(len(s.blocked) for s in both)),
           "gen_tokens": sum(s.n_generated for s in both) / len(both),
           "student_tokens": prev["student_tokens"] + sum(s.n_generated for s in both),
           "teacher_tokens": prev["teacher_tokens"] + sum(s.n_generated for s in dbatch),
           "gen_tokens_per_s": gen_tok / gen_s if gen_s else float("nan"),
           "train_tokens_per_s": float(batch_tokens(both)) / times["train_s"],
           **times, "wall_s": wall_s}  # validation not included
    spec = feed.counts
    if spec["verifications"] or "mtp_acceptance_length" in hist:  # MTP drafts: tokens per model forward
        row["mtp_acceptance_length"] = (spec["accepted"] / spec["verifications"] if spec["verifications"]
                                        else float("nan"))
    if feed.kw.get("judge"):  # the guard's model judge: its cost, in tokens read per episode rolled out
        row["judge_tokens_per_episode"] = spec["judge_tokens"] / spec["episodes"] if spec["episodes"] else float("nan")
    if feed.r.context_budget and batch:  # compaction (or truncation) at the budget: what the episodes became
        episodes = sum(s.subtrace == 0 for s in batch)
        row["subtraces_per_episode"] = len(batch) / episodes
        row["subtrace_tokens"] = batch_tokens(batch) / len(batch)
        row["subtrace_tokens_max"] = float(max(len(s.prompt_ids) + len(s.ids) for s in batch))
        row["truncated_share"] = sum(s.truncated for s in batch) / episodes
    if any(s.versions for s in both):  # partial rollouts: how many samples span an update, how old their tokens are
        tokens = [v for s in both if s.versions for v, m in zip(s.versions, s.gen_mask) if m]
        row["mixed_version_share"] = sum(len({v for v in s.versions if v >= 0}) > 1 for s in both) / len(both)
        row["token_staleness_mean"] = sum(step - v for v in tokens) / max(1, len(tokens))
    if feed.r.dynamic_sampling:  # groups drawn for the step whose rewards all agreed (set aside, or filling the batch)
        row["uniform_groups"] = float(len(feed.uniform))
        row["groups_drawn"] = float(feed.drawn)
    if dbatch and batch:  # distillation beside RL: its samples' reward separately
        row["distill_reward"] = sum(s.reward for s in dbatch) / len(dbatch)
    return row


def train_policy(r: RLConfig, sft: str, pool: list[Task], val: list[Task], *, seed: int, label: str = "rl",
                 scratch: str | Path | None = None, distill: Distill | None = None, judge: str = "",
                 moe: MoEConfig | None = None, engine: tuple[str, dict] = ("torch", {}), rollout_engine: str = "torch",
                 weight_sync: str = "store") -> tuple[torch.nn.Module, object, State]:
    """Train a policy from the `sft` checkpoint: RL on `pool` (may be empty), plus on-policy distillation
    when `distill` is given. `label` (the stage name in the pipeline) names it in the progress bar and in
    POSTTRAIN_KILL_AT; `scratch` makes it resumable; `judge`, a checkpoint, is the guard's model judge in the
    rollouts (validation keeps the rules-only guard); `engine`: the train engine's name and options
    (posttrain.engines.train_options); `rollout_engine`, `weight_sync`: what the workers and teachers generate and
    score with, and how the weights reach them (posttrain.engines.rollout_options). Returns the policy (a
    transformers model), tokenizer, final state."""
    seed_all(seed)
    eng = build_engines(r, sft, with_critic=r.algorithm == "ppo" and bool(pool), rl=bool(pool), moe=moe,
                        engine=engine)
    tok = eng.policy.tokenizer
    ckpt = Path(scratch) / "rl_state.pt" if scratch else None  # the full state, every `checkpoint_every` steps
    if ckpt:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    st = eng.load(ckpt) if ckpt and ckpt.exists() else State()
    if st.step:
        print(f"[{label}] resuming at step {st.step} of {r.steps}", flush=True)
    kw = dict(max_new_tokens=r.max_new_tokens, max_turns=r.max_turns, context_budget=r.context_budget,
              compaction=r.compaction, summary=r.compaction_summary)
    kill_at, hist = kill_step(label), st.history
    domains = sorted({t.domain for t in val})
    best = BestWeights(Path(scratch) if scratch and r.keep == "best" else None, getattr(st, "kept", None))
    def validate(step: int, wall_s: float) -> None:  # generated from the trained weights
        model = eng.policy.hf_model()
        scores = val_scores(as_rollout_engine(model, tok), tok, val, **kw)
        hist["val_score"].append((step, scores["all"]))
        if r.keep == "best":
            best.offer(step, scores["all"], model)
        for d in domains if len(domains) > 1 or distill else ():  # distillation reads its domains' curves
            hist.setdefault(f"val_score/{d}", []).append((step, scores[d]))
        hist["val_wall_s"].append((step, wall_s))

    teachers = TeacherPool(distill.teachers, distill.route, distill.teacher_cpus, engine=rollout_engine,
                           placement=distill.teacher_placement) if distill else None
    workers = WorkerPool(sft, r.rollout_workers, r.worker_cpus, r.worker_threads, teachers=teachers,
                         engine=rollout_engine, record_routes=r.routing_replay, partial=r.partial_rollouts,
                         weight_sync=weight_sync, dtype=r.rollout_dtype)
    feed = Feed(r, pool, distill, workers, seed, st,
                {**kw, "judge": (judge, tuple(r.judge.features)) if judge else None, "stop_check": r.stop_check})
    active_alarms: set[str] = set()
    try:
        if not hist:
            hist.update({"val_score": [], "val_wall_s": []})
            validate(0, 0.0)
        t0 = time.perf_counter() - st.wall_s
        workers.push(eng.policy.weights(), st.step)
        bar = tqdm(range(st.step, r.steps), initial=st.step, total=r.steps, desc=label, mininterval=5)
        for step in bar:
            t_wait = time.perf_counter()
            batch, dbatch, gen_s, gen_tok = feed.collect(step)
            t_train = time.perf_counter()
            stats = eng.update(r, batch, dbatch, distill)
            t_push = time.perf_counter()
            if step + 1 < r.steps:  # no rollout uses the last step's weights
                workers.push(eng.policy.weights(), step + 1)
            times = {"rollout_wait_s": t_train - t_wait, "train_s": t_push - t_train,
                     "push_s": time.perf_counter() - t_push}
            st.attempts += [{"step": step, "task": s.task_id, **b} for s in batch + dbatch for b in s.blocked]
            row = history_row(batch, dbatch, stats, feed, hist, step, gen_s, gen_tok, times, time.perf_counter() - t0)
            for k, v in row.items():
                hist.setdefault(k, []).append(v)
            done = step + 1
            if r.val_every and done % r.val_every == 0 or done == r.steps or _passed(
                    hist["student_tokens"], r.val_every_tokens):
                validate(done, time.perf_counter() - t0)
            st.alarms += alarms.check(hist, r.alarms, active_alarms, done, label, st.alarms)
            bar.set_postfix(reward=f"{row['reward']:.3f}", val=f"{hist['val_score'][-1][1]:.3f}", refresh=False)
            if ckpt and r.checkpoint_every and done % r.checkpoint_every == 0 and done < r.steps:
                best.save()  # before the state that names it
                st = feed.st = feed.snapshot(done, hist, st.attempts, time.perf_counter() - t0, drain=True,
                                             alarms=st.alarms, kept=best.kept)
                eng.save(ckpt, st)
                best.prune()
                checkpointed(ckpt.parent)  # to the artifact store too, when it is remote
                if kill_at == done:  # fault injection for the resume test
                    os.kill(os.getpid(), signal.SIGKILL)
        st = feed.snapshot(r.steps, hist, st.attempts, time.perf_counter() - t0, drain=False, alarms=st.alarms,
                           kept=best.kept)
        model = eng.policy.hf_model()
        if best.kept and best.kept[0] != r.steps:
            model.load_state_dict(best.weights())
            print(f"[{label}] keeping step {best.kept[0]}'s weights (validation {best.kept[1]:.3f}; the last step's "
                  f"{hist['val_score'][-1][1]:.3f})", flush=True)
    finally:
        feed.close()
        workers.close()
        if teachers:
            teachers.close()
        eng.close()
    return model, tok, st


class BestWeights:
    """rl.keep best: a copy of the best-validated weights (ties go to the later step). With a scratch dir the copy
    is written beside each resumable checkpoint, as `best_step<N>.pt`, so a resumed run keeps it."""

    def __init__(self, scratch: Path | None, kept: tuple[int, float] | None):
        self.scratch, self.kept = scratch, kept
        self._weights: dict[str, torch.Tensor] | None = None

    def _path(self) -> Path:
        return self.scratch / f"best_step{self.kept[0]}.pt"

    def offer(self, step: int, score: float, model: torch.nn.Module) -> None:
        if self.kept is None or score >= self.kept[1]:
            self.kept = (step, score)
            self._weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:  # resumed: the copy the checkpoint names
            self._weights = torch.load(self._path(), weights_only=True)
        return self._weights

    def save(self) -> None:
        if self.scratch and self.kept and not self._path().exists():
            tmp = self._path().with_suffix(".tmp")
            torch.save(self.weights(), tmp)
            os.replace(tmp, self._path())

    def prune(self) -> None:
        if self.scratch and self.kept:
            for p in self.scratch.glob("best_step*.pt"):
                if p != self._path():
                    p.unlink()


def kept_metrics(st: State) -> dict[str, float]:
    """rl.keep best: the step whose weights the stage wrote and its validation score (the teachers' figure in OPD)."""
    return {"kept_step": st.kept[0], "val_score_kept": st.kept[1]} if st.kept else {}


def _passed(cumulative: list[float], every: int) -> bool:
    """Whether the last step's cumulative count crossed a multiple of `every` (0: never)."""
    before = cumulative[-2] if len(cumulative) > 1 else 0
    return bool(every) and cumulative[-1] // every > before // every


def kill_step(stage: str) -> int:
    """Fault injection for the resume tests: POSTTRAIN_KILL_AT="<stage>:<step>" SIGKILLs that stage right
    after the checkpoint of that step."""
    name, _, step = os.environ.get("POSTTRAIN_KILL_AT", "").rpartition(":")
    return int(step) if name == stage else -1


def batch_tokens(samples: list[Sample]) -> int:
    return sum(len(s.prompt_ids) + len(s.ids) for s in samples)
