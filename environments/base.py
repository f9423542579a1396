"""What every environment shares: the Task record and the split rule that keeps splits disjoint."""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

SPLITS = ("train", "val", "test")


@dataclass
class Task:
    id: str
    domain: str
    split: str
    prompt: str                       # the user message
    answer: str                       # reference final answer
    demo: list[dict] = field(default_factory=list)  # assistant/tool messages of a demonstration
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(s: str) -> "Task":
        return Task(**json.loads(s))

    def fingerprint(self) -> str:
        """The text that identifies this item in a document (decontamination key): the prompt, plus the
        workspace files where the prompt alone is shared by many items."""
        files = self.meta.get("files") or {}
        return " ".join([self.prompt, *(f"{name}: {body}" for name, body in sorted(files.items()))])

    def prose(self) -> str:
        """The worked example as plain text: the form the pretraining corpus holds it in."""
        think = " ".join(m.get("reasoning_content", "") for m in self.demo if m["role"] == "assistant")
        return f"{self.prose_prompt()} {think} Answer: {self.answer}."

    def prose_prompt(self, thinking: bool = True) -> str:
        """The completion prompt a base model is evaluated with (thinking off: straight to the answer)."""
        return f"Question: {self.prompt} " + ("Reasoning:" if thinking else "Answer:")

    def messages(self, with_demo: bool = False) -> list[dict]:
        msgs = [{"role": "user", "content": self.prompt}]
        return msgs + (list(self.demo) if with_demo else [])


def split_of(key: str) -> str:
    """Splits are a pure function of the problem's canonical key: disjoint by construction."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < 10 else "val" if bucket < 15 else "train"


def collect(domain: str, split: str, n: int, seed: int, make: Callable[[random.Random], tuple[str, Task]],
            max_tries: int = 200_000) -> list[Task]:
    """Draw candidate problems until `n` distinct ones fall into `split`."""
    rng = random.Random(f"{domain}:{split}:{seed}")
    out: dict[str, Task] = {}
    for _ in range(max_tries):
        if len(out) >= n:
            break
        key, task = make(rng)
        if key in out or split_of(f"{domain}:{key}") != split:
            continue
        task.id = f"{domain}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        task.split = split
        out[key] = task
    if len(out) < n:
        raise ValueError(f"{domain}: only {len(out)} distinct {split} problems exist for these knobs (asked {n})")
    return list(out.values())


def compaction_note(calls: list[tuple[str, str, str]]) -> str:
    """The rule-based summary that replaces earlier turns: each tool call and what it returned (the reasoning
    around them is dropped). Environments' training data uses the same words (environments.agentic)."""
    return "Notes: " + " ".join(f"{arg or tool}: {out.strip()}." for tool, arg, out in calls)


# what an episode asks the policy for when it writes its own summary at a compaction (rl.compaction_summary: policy)
SUMMARY_REQUEST = "Context full: write notes."  # short: the request and the notes must fit the budget too


def compacted_prompt(prompt: str, note: str) -> str:
    return f"{prompt}\n{note}"


_THINK_TAG = re.compile(r"</?think>")


def strip_think_blocks(text: str) -> str:
    """`text` without its closed `<think>...</think>` blocks (each from an opening tag to the next closing one);
    an unclosed block stays. Linear: `re.sub(r"<think>.*?</think>", ...)` is quadratic on opening tags alone."""
    out, pos = [], 0
    while (o := text.find("<think>", pos)) >= 0:
        c = text.find("</think>", o + len("<think>"))
        if c < 0:
            break
        out.append(text[pos:o])
        pos = c + len("</think>")
    out.append(text[pos:])
    return "".join(out)


def outside_thinking(text: str) -> str:
    """What a turn says outside its thinking: closed blocks removed, and an unclosed `<think>` counts as thinking
    to the end, a `</think>` with no opening tag as thinking from the start (a prompt that opened the block)."""
    out, start, inside = [], 0, False
    for m in _THINK_TAG.finditer(text):
        if m.group() == "<think>":
            if not inside:
                out.append(text[start:m.start()])
                inside = True
        elif inside:
            inside, start = False, m.end()
        else:
            out, start = [], m.end()
    if not inside:
        out.append(text[start:])
    return "".join(out)


def final_answer(completion: str) -> str:
    """The text after the last think block, without tool calls or the end marker."""
    text = strip_think_blocks(completion)
    text = text.split("<|end|>")[0]
    text = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.S)
    return text.strip()


def verify_number(task: Task, completion: str) -> tuple[float, str]:
    ans = final_answer(completion)
    m = re.fullmatch(r"([+-]?\d+)\s*\.?", ans.strip())  # one whitespace run between two anchors: linear
    if not m:
        return 0.0, f"no single integer in final answer {ans[:40]!r}"
    if int(m.group(1)) == int(task.answer):
        return 1.0, "correct"
    return 0.0, f"wrong: {m.group(1)} != {task.answer}"


def export_jsonl(tasks: Iterable[Task], path: str) -> int:
    """One task per line (id, domain, split, prompt, answer, meta, demo) for other tools to evaluate on."""
    import os
    tmp = f"{path}.tmp"
    n = 0
    with open(tmp, "w") as f:
        for t in tasks:
            f.write(t.to_json() + "\n")
            n += 1
    os.replace(tmp, path)
    return n
