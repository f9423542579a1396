"""The RL loop shared by the specialists, OPD and the cross-stage chains. Rollout workers generate while the trainer trains (asynchronous, with a
staleness bound k; k = 0 is synchronous on-policy), GRPO or critic PPO, the domain's verifier as reward.

Token in, token out: the trainer consumes the exact token ids and behaviour logprobs the workers
produced; nothing is decoded and re-encoded on the way, so the importance ratio measures only the
policy change. Every `checkpoint_every` steps the full state (weights, optimizers, RNG, request cursor,
rollout buffer, curves) goes to the scratch dir; a rerun after a crash continues from it exactly.
"""
from __future__ import annotations

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
from posttrain.chat import pad_id
from posttrain.config import RLConfig
from posttrain.rl.critic import ValueModel
from posttrain.model import load_checkpoint, seed_all
from posttrain.rl.opd_loss import distill_backward
from posttrain.rl.rollout import run_episodes
from posttrain.rl.step import train_step
from posttrain.rl.workers import RolloutBuffer, Sample, WorkerPool
from posttrain.rl.teachers import TeacherPool
from posttrain.train import make_optimizer


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
    teacher_cpus: float = 0.2

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


def _save(path: Path, policy, opt, critic, copt, st: State) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"policy": policy.state_dict(), "opt": opt.state_dict(),
                "critic": critic.state_dict() if critic else None, "copt": copt.state_dict() if copt else None,
                "rng": torch.get_rng_state(), "state": st}, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact


def _load(path: Path, policy, opt, critic, copt) -> State:
    ck = torch.load(path, weights_only=False)  # our own scratch file, written by _save
    policy.load_state_dict(ck["policy"])
    opt.load_state_dict(ck["opt"])
    if critic is not None:
        critic.load_state_dict(ck["critic"])
        copt.load_state_dict(ck["copt"])
    torch.set_rng_state(ck["rng"])
    return ck["state"]


def val_scores(policy, tok, val: list[Task], **kw) -> dict[str, float]:
    """Greedy validation accuracy per domain of `val`, and "all" over every task."""
    eps = run_episodes(policy, tok, val, temperature=0.0, **kw)
    out: dict[str, list[float]] = {"all": []}
    for e in eps:
        out["all"].append(e.reward)
        out.setdefault(e.task.domain, []).append(e.reward)
    return {d: sum(v) / max(1, len(v)) for d, v in out.items()}


def train_policy(r: RLConfig, sft: str, pool: list[Task], val: list[Task], *, seed: int, label: str = "rl",
               scratch: str | Path | None = None, distill: Distill | None = None
               ) -> tuple[torch.nn.Module, object, State]:
    """Train a policy from the `sft` checkpoint: RL on `pool` (may be empty), plus on-policy distillation
    when `distill` is given. `label` (the stage name in the pipeline) names it in the progress bar and in
    POSTTRAIN_KILL_AT; `scratch` makes it resumable. Returns policy, tokenizer, final state."""
    seed_all(seed)
    policy, tok = load_checkpoint(sft)
    critic = ValueModel(sft) if r.algorithm == "ppo" and pool else None
    ref = load_checkpoint(sft)[0].eval() if r.kl_coef > 0 else None
    opt = make_optimizer(policy, r.lr)
    copt = make_optimizer(critic, r.critic_lr) if critic is not None else None
    ckpt = None
    if scratch:  # resumable: the full state goes here every `checkpoint_every` steps
        Path(scratch).mkdir(parents=True, exist_ok=True)
        ckpt = Path(scratch) / "rl_state.pt"
    kill_at = kill_step(label)
    st = State()
    if ckpt and ckpt.exists():
        st = _load(ckpt, policy, opt, critic, copt)
        print(f"[{label}] resuming at step {st.step} of {r.steps}", flush=True)
    kw = dict(max_new_tokens=r.max_new_tokens, max_turns=r.max_turns)
    domains = sorted({t.domain for t in val})

    def validate(step: int) -> None:
        scores = val_scores(policy, tok, val, **kw)
        hist["val_score"].append((step, scores["all"]))
        for d in domains if len(domains) > 1 else ():
            hist.setdefault(f"val_score/{d}", []).append((step, scores[d]))
        hist["val_wall_s"].append((step, time.perf_counter() - t0))

    hist = st.history
    n_rl = r.prompts_per_step if pool else 0
    n_distill = distill.prompts_per_step if distill else 0
    buffer = RolloutBuffer(r.max_staleness, st.groups)
    buffer.dropped, buffer.staleness = st.dropped, Counter(st.staleness)
    dbuffer = RolloutBuffer(r.max_staleness, st.distill_groups)
    rl_req, d_req = (math.ceil(n / r.rollout_workers) for n in (n_rl, n_distill))
    teachers = TeacherPool(distill.teachers, distill.route, distill.teacher_cpus) if distill else None
    workers = WorkerPool(sft, r.rollout_workers, r.worker_cpus, teachers=teachers)
    inflight: deque[Future] = deque()

    def submit() -> None:
        rng = random.Random(seed * 1_000_003 + st.next_request)  # a request's prompts and sampling: pure functions
        tasks = rng.sample(pool, rl_req) if rl_req else []        # of its index, so a resumed run redraws none
        dtasks = distill.draw(rng, d_req, st.next_request) if d_req else []
        extra = {"distill": tuple(dtasks), "teacher_mode": distill.mode, "top_k": distill.top_k} if d_req else {}
        inflight.append(workers.submit(st.next_request % len(workers), tasks, r.group_size, rng.getrandbits(31),
                                       temperature=r.temperature, **extra, **kw))
        st.next_request += 1

    def top_up() -> None:
        # k + 1 steps' worth outstanding: with k = 0 nothing is generated before the weights it must use
        have, per, need = (len(buffer), rl_req, n_rl) if n_rl else (len(dbuffer), d_req, n_distill)
        while have + len(inflight) * per < (r.max_staleness + 1) * need:
            submit()
            have = len(buffer) if n_rl else len(dbuffer)

    try:
        t0 = time.perf_counter() - st.wall_s
        if not hist:
            hist.update({"val_score": [], "val_wall_s": []})
            validate(0)
            hist["val_wall_s"][-1] = (0, 0.0)
            t0 = time.perf_counter()
        workers.push(policy.state_dict(), st.step)
        bar = tqdm(range(st.step, r.steps), initial=st.step, total=r.steps, desc=label, mininterval=5)
        for step in bar:
            top_up()
            gen_s = gen_tok = 0.0
            while True:
                buffer.drop_stale(step)
                dbuffer.drop_stale(step)
                if len(buffer) >= n_rl and len(dbuffer) >= n_distill:
                    break
                samples, info = inflight.popleft().result()
                buffer.add([s for s in samples if s.teacher is None])
                dbuffer.add([s for s in samples if s.teacher is not None])
                gen_s, gen_tok = gen_s + info["seconds"], gen_tok + info["tokens"]
                top_up()
            batch = buffer.take(n_rl, step) if n_rl else []
            dbatch = dbuffer.take(n_distill, step) if n_distill else []
            policy.train()
            t_train = time.perf_counter()
            extra = (lambda: distill_backward(
                policy, dbatch, pad_id(tok), mode=distill.mode, coef=distill.coef,
                reward_weight=distill.reward_weight, temperature=r.temperature, clip_eps=r.clip_eps,
                is_lower=r.is_lower, is_upper=r.is_upper, max_cells=r.micro_batch_cells)) if dbatch else None
            stats = train_step(r, policy, opt, batch, pad_id(tok), critic, copt, ref, extra)
            train_s = time.perf_counter() - t_train
            policy.eval()
            workers.push(policy.state_dict(), step + 1)
            both = batch + dbatch
            rewards = torch.tensor([s.reward for s in batch or dbatch])
            st.attempts += [{"step": step, "task": s.task_id, **b} for s in both for b in s.blocked]
            prev = {k: hist[k][-1] if hist.get(k) else 0.0 for k in ("student_tokens", "teacher_tokens")}
            row = {"reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
                   **stats, "staleness_mean": sum(step - s.version for s in both) / len(both),
                   "stale_dropped": float(buffer.dropped + dbuffer.dropped),
                   "blocked": float(sum(len(s.blocked) for s in both)),
                   "gen_tokens": sum(s.n_generated for s in both) / len(both),
                   "student_tokens": prev["student_tokens"] + sum(s.n_generated for s in both),
                   "teacher_tokens": prev["teacher_tokens"] + sum(s.n_generated for s in dbatch),
                   "gen_tokens_per_s": gen_tok / gen_s if gen_s else float("nan"),
                   "train_tokens_per_s": float(batch_tokens(both)) / train_s,
                   "wall_s": time.perf_counter() - t0}  # validation below not included
            if dbatch and n_rl:  # distillation beside RL: its samples' reward separately
                row["distill_reward"] = sum(s.reward for s in dbatch) / len(dbatch)
            for k, v in row.items():
                hist.setdefault(k, []).append(v)
            done = step + 1
            if r.val_every and done % r.val_every == 0 or done == r.steps or _passed(
                    hist["student_tokens"], r.val_every_tokens):
                validate(done)
            bar.set_postfix(reward=f"{row['reward']:.3f}", val=f"{hist['val_score'][-1][1]:.3f}", refresh=False)
            if ckpt and r.checkpoint_every and done % r.checkpoint_every == 0 and done < r.steps:
                while inflight:  # the buffers are saved whole: in-flight rollouts are part of the state
                    samples = inflight.popleft().result()[0]
                    buffer.add([s for s in samples if s.teacher is None])
                    dbuffer.add([s for s in samples if s.teacher is not None])
                st = State(done, st.next_request, buffer.groups, dbuffer.groups, buffer.dropped + dbuffer.dropped,
                           dict(buffer.staleness + dbuffer.staleness), hist, st.attempts, time.perf_counter() - t0)
                _save(ckpt, policy, opt, critic, copt, st)
                if kill_at == done:  # fault injection for the resume test
                    os.kill(os.getpid(), signal.SIGKILL)
        st = State(r.steps, st.next_request, [], [], buffer.dropped + dbuffer.dropped,
                   dict(buffer.staleness + dbuffer.staleness), hist, st.attempts, time.perf_counter() - t0)
    finally:
        for f in inflight:
            f.cancel()
        workers.close()
        if teachers:
            teachers.close()
    return policy, tok, st


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
