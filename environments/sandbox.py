"""Per-episode workspace, the tools an agent may call, and the anti-reward-hacking guard.

Stage 1, rules: string patterns on the call (grader paths, traversal, absolute paths, downloads, shell
tricks), then the path check: the path must resolve to a plain file or folder inside the workspace (no
symlinks, devices, fifos, escapes). Stage 2, optional, a judge: a function `(tool, arg, workspace) ->
reason | None` that sees the episode so far in `workspace.context`; posttrain.judge asks a model about the
calls that look suspicious (environments.guard). Without one the guard is rules only.

A blocked call returns dummy output and the episode goes on (GLM-5's guard), so the attempt earns
nothing but the trajectory stays trainable. Tools only read regular files, with an output cap and a
time limit, and have no network.
"""
from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # noqa: F401  (imported up front, not lazily during a tool call)
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
TIME_LIMIT_S = 2.0
TOOLS = ("read", "ls")

RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"grader|hidden|answer|solution|tests?[/\\_.]", re.I), "grader or test path"),
    (re.compile(r"[a-z][a-z0-9+.-]*://|\b(curl|wget|ftp|scp|nc|ssh)\b", re.I), "download attempt"),
    (re.compile(r"^\s*[/\\~]"), "absolute or home path"),
    (re.compile(r"(^|[\\/])\.\.+([\\/]|$)|%2e|%2f|%5c", re.I), "path escape"),
    (re.compile(r"[$`|;&<>*?\x00-\x1f]"), "shell or control characters"),
]

Judge = Callable[[str, str, "Workspace"], "str | None"]


def rule_check(tool: str, arg: str) -> str | None:
    for pattern, reason in RULES:
        if pattern.search(arg):
            return reason
    return None


def path_check(tool: str, arg: str, ws: "Workspace") -> str | None:
    """The path must stay a plain file or folder inside the workspace."""
    if tool not in TOOLS:
        return None
    return None if ws.resolve(arg) is not None else "outside workspace or not a plain file"


@dataclass
class Workspace:
    root: Path
    grader_dir: Path
    judge: Judge | None = None
    blocked: list[dict] = field(default_factory=list)
    context: dict = field(default_factory=dict)  # the episode so far, for the judge: {"prompt", "calls"}

    @staticmethod
    def create(files: dict[str, str], grader: str, judge: Judge | None = None) -> "Workspace":
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

    def resolve(self, arg: str) -> Path | None:
        """The real path of `arg` if it is a plain file or folder inside the workspace, else None. Any argument
        the OS cannot take (a NUL, a lone surrogate, a name over NAME_MAX bytes, a path over PATH_MAX) is None,
        not an exception: a tool call must never end the episode it belongs to."""
        try:
            return self._resolve(arg)
        except (OSError, ValueError):  # UnicodeEncodeError is a ValueError
            return None

    def _resolve(self, arg: str) -> Path | None:
        encoded = arg.encode("utf-8")  # a lone surrogate raises here, before any system call sees it
        if b"\x00" in encoded or len(encoded) > 4096 or any(len(c) > 255 for c in encoded.split(b"/")):
            return None
        root = self.root.resolve()
        candidate = root / arg if arg else root
        if not candidate.resolve().is_relative_to(root):
            return None
        # no component may be a symlink: checking the final path alone misses a linked folder
        p = root
        for part in candidate.relative_to(root).parts:
            p = p / part
            if p.is_symlink():
                return None
        if candidate.exists():
            st = candidate.lstat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                return None
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:  # a hard link may be the grader's file under a new name
                return None
        return candidate

    def _run(self, tool: str, arg: str) -> str:
        target = self.resolve(arg)
        if tool == "ls":
            if not target.is_dir():
                return "error: not a directory"
            return " ".join(sorted(os.listdir(target)))[:MAX_OUTPUT]
        if not target.is_file():
            return "error: no such file"
        # O_NOFOLLOW + fstat: a file swapped for a link or device after the check is still refused
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                return "error: not a regular file"
            return os.read(fd, MAX_OUTPUT).decode("utf-8", "replace")
        finally:
            os.close(fd)

    def call(self, tool: str, arg: str) -> str:
        """Run one tool call through the guard; blocked calls are recorded and answered with dummy output."""
        arg = arg.strip()
        if tool not in TOOLS:
            return f"error: unknown tool {tool!r} (tools: {', '.join(TOOLS)})"
        checks = [("rules", lambda: rule_check(tool, arg)), ("path", lambda: path_check(tool, arg, self))]
        if self.judge is not None:
            checks.append(("judge", lambda: self.judge(tool, arg, self)))
        for stage, check in checks:
            reason = check()
            if reason is not None:
                self.blocked.append({"tool": tool, "arg": arg, "stage": stage, "reason": reason})
                return BLOCKED_OUTPUT
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            return pool.submit(self._run, tool, arg).result(timeout=TIME_LIMIT_S)
        except concurrent.futures.TimeoutError:
            return "error: time limit"
        except OSError as e:
            return f"error: {e.strerror or 'io error'}"
        except ValueError:  # an argument the path check let through but the OS cannot encode
            return "error: invalid path"
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
