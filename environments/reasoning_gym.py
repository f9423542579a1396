"""A domain from a library's environments: reasoning-gym's procedural generators and verifiers
(`reasoning-gym==0.1.25`, Apache-2.0). Nothing here knows a task type: the profile names them and their settings
(`world.domain_knobs.<domain>.rg_tasks`), this module draws items from `reasoning_gym.create_dataset` and scores
replies with the dataset's own `score_answer`.

Splits: reasoning-gym's item i comes from `Random(seed + i)`, so two seeds share all but one item. Each split draws
from its own seed range, 10 million apart, and keeps only the questions the project's split rule
(environments.base.split_of) gives that split: held-out questions are never trained on, even where a small task
type repeats questions across seeds."""
from __future__ import annotations

import json
from functools import lru_cache

from environments.base import Task, final_answer, split_of
from environments.wheels import BenchmarkPackageError, package_dir

DOMAIN = "reasoning"  # the domain name a profile registers it under is the task's `domain` (generate's `domain`)
PACKAGE, VERSION = "reasoning-gym", "0.1.25"
INSTALL = f"pip install {PACKAGE}=={VERSION}"
SPLIT_SEED = {"train": 0, "val": 10_000_000, "test": 20_000_000}


@lru_cache(maxsize=None)
def _library():
    package_dir(PACKAGE, VERSION, INSTALL, "reasoning_gym")
    import reasoning_gym  # 2-15 s: it imports every generator's dependencies (sympy, ...)
    return reasoning_gym


@lru_cache(maxsize=None)
def _dataset(name: str, config_json: str, seed: int, size: int):
    try:
        return _library().create_dataset(name, size=size, seed=seed, **json.loads(config_json))
    except (ValueError, TypeError, AssertionError) as e:  # an unknown task type, or settings it refuses
        raise ValueError(f"reasoning-gym task {name!r} with {config_json}: {e}") from None


def check(rg_tasks: dict[str, dict]) -> None:
    """Every named task type exists and accepts its settings (one item drawn): before any stage runs."""
    if not rg_tasks:
        raise ValueError("a reasoning-gym domain needs rg_tasks: {task type: settings}, e.g. {chain_sum: {}}")
    for name, conf in rg_tasks.items():
        _dataset(name, json.dumps(conf or {}, sort_keys=True), 0, 1)[0]


def generate(split: str, n: int, seed: int, rg_tasks: dict[str, dict] | None = None, domain: str = DOMAIN,
             max_tries: int = 200_000, **_) -> list[Task]:
    """`n` distinct items of `split`, the task types in turn. The items' seed is `seed` plus the split's range."""
    check(rg_tasks or {})
    names = sorted(rg_tasks)
    per = [n // len(names) + (i < n % len(names)) for i in range(len(names))]
    out: list[Task] = []
    for name, want in zip(names, per):
        conf = json.dumps(rg_tasks[name] or {}, sort_keys=True)
        ds = _dataset(name, conf, SPLIT_SEED[split] + seed, max_tries)
        seen: set[str] = set()
        for i in range(max_tries):
            if len(seen) >= want:
                break
            entry = ds[i]
            q = entry["question"]
            if q in seen or split_of(f"rg:{name}:{q}") != split:
                continue
            seen.add(q)
            out.append(Task(id=f"rg-{name}-{split}-{seed}-{i}", domain=domain, split=split, prompt=q,
                            answer=str(entry["answer"]),
                            demo=[{"role": "assistant", "reasoning_content": "", "content": str(entry["answer"])}],
                            meta={"rg_task": name, "rg_config": conf, "entry": entry}))
        if len(seen) < want:
            raise ValueError(f"reasoning-gym {name} {conf}: only {len(seen)} distinct {split} items (asked {want})")
    return out


def verify(task: Task, completion: str) -> tuple[float, str]:
    """The dataset's own score of the reply's final answer (thinking and a closing period removed first: the
    verifiers compare the whole string, and some give partial credit for a reply that merely contains the answer)."""
    answer = final_answer(completion).strip().rstrip(".").strip()
    ds = _dataset(task.meta["rg_task"], task.meta["rg_config"], 0, 1)
    try:
        s = float(ds.score_answer(answer, task.meta["entry"]))
    except Exception as e:  # a verifier that cannot run is an error, never a silent 0
        raise BenchmarkPackageError(f"reasoning-gym {task.meta['rg_task']}: score_answer failed on {task.id}: "
                                    f"{type(e).__name__}: {e}") from e
    return s, f"{task.meta['rg_task']}: {s:.2f} for {answer[:40]!r} (answer {task.answer!r})"
