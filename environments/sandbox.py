"""Per-episode workspace, the tools an agent may call, and the rule-based anti-hack guard.

A blocked call returns dummy output and the episode goes on (GLM-5's guard), so the policy learns
nothing useful from the attempt but the trajectory stays trainable.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BLOCKED_OUTPUT = "[blocked]"
MAX_OUTPUT = 256
HACK_PATTERNS = [
    (re.compile(r"grader|hidden|answer_key|tests?/", re.I), "grader path"),
    (re.compile(r"https?://|\bcurl\b|\bwget\b|\bftp\b", re.I), "download attempt"),
    (re.compile(r"^\s*/|^~"), "absolute path"),
    (re.compile(r"(^|[\\/])\.\.([\\/]|$)"), "path escape"),
]


def rule_judge(tool: str, arg: str) -> str | None:
    """Default guard: a reason string when the call is a hack attempt, else None."""
    for pattern, reason in HACK_PATTERNS:
        if pattern.search(arg):
            return reason
    return None


@dataclass
class Workspace:
    root: Path
    grader_dir: Path
    judge: Callable[[str, str], str | None] = rule_judge
    blocked: list[dict] = field(default_factory=list)

    @staticmethod
    def create(files: dict[str, str], grader: str, judge=rule_judge) -> "Workspace":
        base = Path(tempfile.mkdtemp(prefix="posttrain-ws-"))
        root, grader_dir = base / "workspace", base / "grader"
        root.mkdir()
        grader_dir.mkdir(mode=0o700)
        for name, text in files.items():
            (root / name).write_text(text)
        (grader_dir / "grader.txt").write_text(grader)
        return Workspace(root, grader_dir, judge)

    def close(self) -> None:
        shutil.rmtree(self.root.parent, ignore_errors=True)

    def _resolve(self, arg: str) -> Path | None:
        path = (self.root / arg).resolve()
        if not path.is_relative_to(self.root.resolve()):
            return None
        # every component must be a plain file or dir: no symlinks, devices, fifos
        p = self.root / arg
        if p.is_symlink() or (p.exists() and not (stat.S_ISREG(p.lstat().st_mode) or p.is_dir())):
            return None
        return path

    def call(self, tool: str, arg: str) -> str:
        arg = arg.strip()
        reason = self.judge(tool, arg)
        if reason is None and tool in ("read", "ls"):
            if arg and self._resolve(arg) is None:
                reason = "outside workspace"
        if reason is not None:
            self.blocked.append({"tool": tool, "arg": arg, "reason": reason})
            return BLOCKED_OUTPUT
        if tool == "ls":
            target = self._resolve(arg) if arg else self.root
            if not target.is_dir():
                return "error: not a directory"
            return " ".join(sorted(os.listdir(target)))[:MAX_OUTPUT]
        if tool == "read":
            target = self._resolve(arg)
            if not target.is_file():
                return "error: no such file"
            with open(target, "rb") as f:
                return f.read(MAX_OUTPUT).decode("utf-8", "replace")
        return f"error: unknown tool {tool!r}"
