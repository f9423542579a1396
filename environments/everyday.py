"""Everyday instructions as prompts for on-policy distillation from the base model (`opd.everyday_prompts`): ordinary
requests outside the task world (posttrain/replay.py's, disjoint from the held-out chat suite), answered with
thinking off. There is no verifier: the base model, as a teacher, is their only signal."""
from __future__ import annotations

from environments.base import Task

DOMAIN = "everyday"


def tasks(prompts: list[str]) -> list[Task]:
    return [Task(id=f"everyday-{i:03d}", domain=DOMAIN, split="rl", prompt=p, answer="",
                 meta={"thinking_turns": [False]}) for i, p in enumerate(prompts)]


def verify(task: Task, completion: str) -> tuple[float, str]:
    return 0.0, "an everyday instruction: no verifier (taught by distillation only)"
