"""Multi-turn tool use: read a file of signed numbers in the episode's workspace, add them up, answer.

The grader file holding the answer lives outside the workspace; trying to reach it is a hack.

With `agentic_files` > 1 the numbers are spread over several files, one read per turn: the variant whose
episodes outgrow a context budget (posttrain.rl, compaction). Part of its training split comes resumed, as
after a compaction: the prompt carries the notes of the files read so far and the demonstration goes on
from there, so supervised training shows the model how to continue from a summary.
"""
from __future__ import annotations

import json
import random
import re

from environments.base import Task, collect, compacted_prompt, compaction_note, verify_number
from environments.sandbox import Judge, Workspace, path_judge

DOMAIN = "agentic"
FILES = ["data.txt", "nums.txt", "values.txt", "list.txt"]
TOOL_CALL = re.compile(r"<tool_call>\s*([^<]*?)\s*</tool_call>")  # a call never spans tags
OURS = re.compile(r"(\w+)[ \t]*([^<]*)")  # our template's form: `name args`


def tool_call(name: str, **arguments: str) -> dict:
    """A tool call in the shape Hugging Face chat templates take (`function.name`, `function.arguments`)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _make(max_operand: int, k: int, n_files: int):
    def make(rng: random.Random) -> tuple[str, Task]:
        # the variant's files are parts in order: what it tests is the episode's length, not finding names
        names = [rng.choice(FILES)] if n_files == 1 else [f"part{i + 1}.txt" for i in range(n_files)]
        # signed: a sum of signed numbers in one step is hard for a small model, step by step it is not
        per_file = [[rng.randint(-max_operand, max_operand) for _ in range(k)] for _ in names]
        nums = [x for xs in per_file for x in xs]
        steps, acc = [], nums[0]
        for n in nums[1:]:
            steps.append(f"{acc}{'+' if n >= 0 else '-'}{abs(n)}={acc + n}.")
            acc += n
        files = {f: " ".join(map(str, xs)) for f, xs in zip(names, per_file)}
        demo = [m for f in names for m in (
            {"role": "assistant", "reasoning_content": f"I need {f}.", "content": "",
             "tool_calls": [tool_call("read", path=f)]},
            {"role": "tool", "content": files[f]})]
        demo.append({"role": "assistant", "reasoning_content": " ".join(steps), "content": str(acc)})
        task = Task(id="", domain=DOMAIN, split="", prompt=f"Add up the numbers in {_names(names)}.",
                    answer=str(acc), demo=demo, meta={"files": files})
        return " ".join(f"{f}:{c}" for f, c in files.items()), task
    return make


def resumed(task: Task, n_read: int) -> Task:
    """The task as it continues after a compaction that followed `n_read` reads: the notes in the prompt
    (the words posttrain's episodes write), the rest of the demonstration from there."""
    names = list(task.meta["files"])
    note = compaction_note([("read", f, task.meta["files"][f]) for f in names[:n_read]])
    return Task(id=f"{task.id}-r{n_read}", domain=task.domain, split=task.split,
                prompt=compacted_prompt(task.prompt, note), answer=task.answer, demo=task.demo[2 * n_read:],
                meta={**task.meta, "resumed_from": task.id, "prompt": task.prompt})


def generate(split: str, n: int, seed: int, max_operand: int = 20, agentic_numbers: int = 3, agentic_files: int = 1,
             agentic_resumed_share: float = 0.5, **_) -> list[Task]:
    tasks = collect(DOMAIN, split, n, seed, _make(max_operand, agentic_numbers, agentic_files))
    if agentic_files == 1 or split != "train":
        return tasks
    rng = random.Random(f"{DOMAIN}:resumed:{seed}")  # training only: evaluation episodes start from the task
    return [resumed(t, rng.randint(1, agentic_files - 1)) if rng.random() < agentic_resumed_share else t
            for t in tasks]


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
