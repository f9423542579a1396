"""Per-episode workspace, the tools an agent may call, and the anti-reward-hacking guard.

Stage 1, rules: string patterns on the call (grader paths, traversal, absolute paths, downloads, shell
tricks), then the path check: walking the path from the workspace's directory descriptor, one component at a
time with O_NOFOLLOW, it must reach a plain file or folder (no symlinks, devices, fifos, hard links, `..`).
Nothing is resolved or opened by path: the descriptor the check ends on is the one the tool reads, so a folder
swapped for a symlink between a check and its use cannot redirect it. Stage 2, optional, a judge: a function
`(tool, arg, workspace) -> reason | None` that sees the episode so far in `workspace.context`; posttrain.judge asks
a model about the calls that look suspicious (environments.guard). Without one the guard is rules only.

A blocked call returns dummy output and the episode goes on (GLM-5's guard), so the attempt earns
nothing but the trajectory stays trainable. Tools only read regular files, with an output cap and a
time limit, and have no network. Every rule runs in linear time on an argument capped at MAX_ARG, and every
answer, errors included, is capped at MAX_OUTPUT characters.
"""
from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # noqa: F401  (imported up front, not lazily during a tool call)
import errno
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BLOCKED_OUTPUT = "[blocked]"
MAX_OUTPUT = 256
MAX_ARG = 1024  # characters of a tool's argument; a longer one is blocked before any rule reads it
TIME_LIMIT_S = 2.0
TOOLS = ("read", "ls")

# each pattern is a literal or a single character class: no nested quantifier, so a search is linear in the input
RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"grader|hidden|answer|solution|tests?[/\\_.]", re.I), "grader or test path"),
    (re.compile(r"://|\b(curl|wget|ftp|scp|nc|ssh)\b", re.I), "download attempt"),
    (re.compile(r"^\s*[/\\~]"), "absolute or home path"),
    (re.compile(r"(^|[\\/])\.\.+([\\/]|$)|%2e|%2f|%5c", re.I), "path escape"),
    (re.compile(r"[$`|;&<>*?\x00-\x1f]"), "shell or control characters"),
]

Judge = Callable[[str, str, "Workspace"], "str | None"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def rule_check(tool: str, arg: str) -> str | None:
    if len(arg) > MAX_ARG:
        return f"argument over {MAX_ARG} characters"
    for pattern, reason in RULES:
        if pattern.search(arg):
            return reason
    return None


class Refused(Exception):
    """The path does not lead to a plain file or folder inside the workspace; the message says why."""


# O_PATH opens a name without opening the file it names (no side effect of a device or fifo); where the OS lacks
# it, a nonblocking read-only open stands in
_PATH = getattr(os, "O_PATH", 0)
_WALK = (_PATH or os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY) | os.O_NOFOLLOW | os.O_CLOEXEC


def _swap(old: int, new: int) -> int:
    os.close(old)
    return new


def _step(fd: int, name: str, want_dir: bool) -> int:
    """The descriptor of `name` inside the folder `fd` (which it closes), never following a link."""
    try:
        nxt = os.open(name, _WALK, dir_fd=fd)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink (without O_PATH); ENAMETOOLONG and the like
        raise Refused("a symlink" if e.errno == errno.ELOOP else e.strerror or "cannot open") from None
    try:
        st = os.fstat(nxt)
        if stat.S_ISDIR(st.st_mode):
            return _swap(fd, nxt)
        if stat.S_ISLNK(st.st_mode):
            raise Refused("a symlink")
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a plain file or folder")
        if want_dir:  # a file where a folder should be: an honest mistake, not an escape
            raise FileNotFoundError(name)
        if st.st_nlink > 1:  # a hard link may be the grader's file under a new name
            raise Refused("a hard link")
        if _PATH:  # open the file itself for reading, by name in the same folder, and check it is the one stat-ed
            real = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
            got = os.fstat(real)
            if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                os.close(real)
                raise Refused("swapped while opened")
            nxt = _swap(nxt, real)
        return _swap(fd, nxt)
    except BaseException:
        os.close(nxt)
        raise


def _capped(text: str) -> str:
    return text[:MAX_OUTPUT]


@dataclass
class Workspace:
    root: Path
    grader_dir: Path
    judge: Judge | None = None
    blocked: list[dict] = field(default_factory=list)
    context: dict = field(default_factory=dict)  # the episode so far, for the judge: {"prompt", "calls"}
    _root_fd: int = -1

    @staticmethod
    def create(files: dict[str, str], grader: str, judge: Judge | None = None) -> "Workspace":
        base = Path(tempfile.mkdtemp(prefix="posttrain-ws-"))
        root, grader_dir = base / "workspace", base / "grader"
        root.mkdir()
        grader_dir.mkdir(mode=0o700)
        for name, text in files.items():
            (root / name).write_text(text)
        (grader_dir / "grader.txt").write_text(grader)
        return Workspace(root, grader_dir, judge, _root_fd=os.open(root, _DIR))

    def close(self) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
        remove_tree(self.root.parent)

    def open_beneath(self, arg: str) -> tuple[int, os.stat_result]:
        """A descriptor for `arg` and its stat: walked from the workspace's own descriptor a component at a time
        without following anything, it is a plain folder (readable, for listing) or a plain file with one link
        (readable). A symlink anywhere, `..`, a special file or a hard-linked file is Refused; a missing one (or
        a file where a folder should be) is FileNotFoundError. The caller closes the descriptor."""
        encoded = arg.encode("utf-8")  # a lone surrogate raises here (ValueError), before any system call sees it
        if b"\x00" in encoded or len(encoded) > 4096:
            raise Refused("not a path")
        if self._root_fd < 0:
            self._root_fd = os.open(self.root, _DIR)
        parts = [p for p in arg.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise Refused("outside workspace")
        fd = os.dup(self._root_fd)
        try:
            for part in parts[:-1]:
                fd = _step(fd, part, want_dir=True)
            if parts:
                fd = _step(fd, parts[-1], want_dir=False)
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode) and _PATH:  # a path-only descriptor: open the folder itself to list it
                fd = _swap(fd, os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd))
            return fd, st
        except BaseException:
            os.close(fd)
            raise

    def _run(self, tool: str, fd: int, st: os.stat_result) -> str:
        try:
            if tool == "ls":
                if not stat.S_ISDIR(st.st_mode):
                    return "error: not a directory"
                # names as the OS gives them; undecodable bytes shown as U+FFFD, never as lone surrogates
                names = " ".join(sorted(os.listdir(fd)))
                return _capped(names.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            if not stat.S_ISREG(st.st_mode):
                return "error: no such file"
            return os.read(fd, MAX_OUTPUT).decode("utf-8", "replace")
        finally:
            os.close(fd)  # this thread's own descriptor: one that outlives the time limit is still closed here

    def call(self, tool: str, arg: str) -> str:
        """Run one tool call through the guard; blocked calls are recorded and answered with dummy output. Never
        raises: whatever the argument, the answer is text of at most MAX_OUTPUT characters."""
        if not isinstance(tool, str) or not isinstance(arg, str):
            return "error: a tool's name and argument must be text"
        if tool not in TOOLS:
            return _capped(f"error: unknown tool {tool[:32]!r} (tools: {', '.join(TOOLS)})")
        arg = arg.strip()
        reason = rule_check(tool, arg)
        if reason is not None:
            return self._block(tool, arg, "rules", reason)
        try:
            fd, st = self.open_beneath(arg)
        except FileNotFoundError:
            return "error: no such directory" if tool == "ls" else "error: no such file"
        except (Refused, ValueError) as e:  # ValueError: an argument the OS cannot encode
            return self._block(tool, arg, "path", f"outside workspace or not a plain file ({e})")
        except OSError as e:
            return _capped(f"error: {e.strerror or 'io error'}")
        try:
            if self.judge is not None and (reason := self.judge(tool, arg, self)) is not None:
                return self._block(tool, arg, "judge", reason)
            pool = concurrent.futures.ThreadPoolExecutor(1)
            try:
                return _capped(pool.submit(self._run, tool, os.dup(fd), st).result(timeout=TIME_LIMIT_S))
            except concurrent.futures.TimeoutError:
                return "error: time limit"
            except OSError as e:
                return _capped(f"error: {e.strerror or 'io error'}")
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        finally:
            os.close(fd)

    def _block(self, tool: str, arg: str, stage: str, reason: str) -> str:
        self.blocked.append({"tool": tool, "arg": arg[:MAX_ARG], "stage": stage, "reason": reason})
        return BLOCKED_OUTPUT


def remove_tree(path: Path) -> None:
    """Remove a folder and everything under it, however deep, without following a link. shutil.rmtree recurses
    once per level (RecursionError past ~1,000 folders, leaving the tree behind); here every folder found below
    a child of `path` is first moved up to `path` itself, so no walk is deeper than two levels and no more than
    two descriptors are open. Stops, leaving what it cannot remove, after a pass that removed nothing."""
    try:
        top = os.open(path, _DIR)
    except OSError:
        return
    moved, progress = 0, True
    try:
        while progress and (names := os.listdir(top)):
            progress = False
            for name in names:
                try:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=top, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=top)
                        progress = True
                        continue
                    sub = os.open(name, _DIR, dir_fd=top)
                    try:
                        for child in os.listdir(sub):
                            if stat.S_ISDIR(os.stat(child, dir_fd=sub, follow_symlinks=False).st_mode):
                                while _exists(top, f".rm{moved}"):
                                    moved += 1
                                os.rename(child, f".rm{moved}", src_dir_fd=sub, dst_dir_fd=top)
                            else:
                                os.unlink(child, dir_fd=sub)
                            progress = True
                    finally:
                        os.close(sub)
                    os.rmdir(name, dir_fd=top)
                    progress = True
                except FileNotFoundError:
                    progress = True  # gone meanwhile
                except PermissionError:  # a folder we may not list or change: open it up for the next pass
                    try:
                        os.chmod(name, 0o700, dir_fd=top)
                        progress = True
                    except OSError:
                        pass
                except OSError:
                    pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
