"""Multi-step arithmetic: `a op b op c ...`; the demonstration thinks one step per operation."""
from __future__ import annotations

import random

from environments.base import Task, collect, verify_number

DOMAIN = "reasoning"


def _make(max_operand: int, n_ops: int):
    def make(rng: random.Random) -> tuple[str, Task]:
        nums = [rng.randint(0, max_operand) for _ in range(n_ops + 1)]
        ops = [rng.choice("+-") for _ in range(n_ops)]
        expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
        steps, acc = [], nums[0]
        for o, n in zip(ops, nums[1:]):
            new = acc + n if o == "+" else acc - n
            steps.append(f"{acc}{o}{n}={new}.")
            acc = new
        task = Task(id="", domain=DOMAIN, split="", prompt=f"Compute {expr}.", answer=str(acc),
                    demo=[{"role": "assistant", "reasoning_content": " ".join(steps), "content": str(acc)}])
        return expr, task
    return make


def generate(split: str, n: int, seed: int, max_operand: int = 20, n_ops: int = 2, **_) -> list[Task]:
    return collect(DOMAIN, split, n, seed, _make(max_operand, n_ops))


verify = verify_number


def shortcut(task: Task) -> list[dict]:
    """A lazy teacher's demonstration: the right answer with no worked steps (a tiny student cannot copy it)."""
    return [{"role": "assistant", "reasoning_content": "", "content": task.answer}]
