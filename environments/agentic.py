"""Multi-turn tool use: read a file of signed numbers in the episode's workspace, add them up, answer.

The grader file holding the answer lives outside the workspace; trying to reach it is a hack.
"""
from __future__ import annotations

import json
import random
import re

from environments.base import Task, collect, verify_number
from environments.sandbox import Judge, Workspace, path_judge

DOMAIN = "agentic"
FILES = ["data.txt", "nums.txt", "values.txt", "list.txt"]
TOOL_CALL = re.compile(r"<tool_call>\s*([^<]*?)\s*</tool_call>")  # a call never spans tags
OURS = re.compile(r"(\w+)[ \t]*([^<]*)")  # our template's form: `name args`


def tool_call(name: str, **arguments: str) -> dict:
    """A tool call in the shape Hugging Face chat templates take (`function.name`, `function.arguments`)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _make(max_operand: int, k: int):
    def make(rng: random.Random) -> tuple[str, Task]:
        fname = rng.choice(FILES)
        # signed: a sum of signed numbers in one step is hard for a small model, step by step it is not
        nums = [rng.randint(-max_operand, max_operand) for _ in range(k)]
        steps, acc = [], nums[0]
        for n in nums[1:]:
            steps.append(f"{acc}{'+' if n >= 0 else '-'}{abs(n)}={acc + n}.")
            acc += n
        content = " ".join(map(str, nums))
        demo = [
            {"role": "assistant", "reasoning_content": f"I need {fname}.", "content": "",
             "tool_calls": [tool_call("read", path=fname)]},
            {"role": "tool", "content": content},
            {"role": "assistant", "reasoning_content": " ".join(steps), "content": str(acc)},
        ]
        task = Task(id="", domain=DOMAIN, split="", prompt=f"Add up the numbers in {fname}.", answer=str(acc),
                    demo=demo, meta={"files": {fname: content}})
        return f"{fname}:{content}", task
    return make


def generate(split: str, n: int, seed: int, max_operand: int = 20, agentic_numbers: int = 3, **_) -> list[Task]:
    return collect(DOMAIN, split, n, seed, _make(max_operand, agentic_numbers))


def open_workspace(task: Task, judge: Judge = path_judge) -> Workspace:
    """The episode's sandbox: the task's files in, the grader (the answer) outside the agent's reach."""
    return Workspace.create(task.meta["files"], grader=task.answer, judge=judge)


def parse_tool_call(text: str) -> tuple[str, str] | None:
    """(tool, argument) from the first complete `<tool_call>` block, ours (`read data.txt`) or Hermes/Qwen JSON
    (`{"name": "read", "arguments": {"path": "data.txt"}}`), or from a turn that is one JSON call (Llama-3.x:
    `{"name": "read", "parameters": {...}}`); None when there is none or it is malformed."""
    m = TOOL_CALL.search(text)
    body = m.group(1) if m else _final_text(text)
    if body.startswith("{"):
        return _json_call(body)
    ours = OURS.fullmatch(body) if m else None
    return (ours.group(1), ours.group(2).strip()) if ours else None


def _final_text(text: str) -> str:
    return re.sub(r"<think>.*?</think>", "", text, flags=re.S).strip()


def _json_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
        args = call.get("arguments", call.get("parameters", {}))
        args = json.loads(args) if isinstance(args, str) else args
        value = args.get("path", next(iter(args.values()), "")) if isinstance(args, dict) else args
    except (ValueError, AttributeError):
        return None
    return (call["name"], str(value).strip()) if isinstance(call.get("name"), str) else None


verify = verify_number


def shortcut(task: Task) -> list[dict]:
    """A lazy teacher's demonstration: reads the file, then states the sum with no worked steps."""
    return [*task.demo[:-1], {**task.demo[-1], "reasoning_content": ""}]
