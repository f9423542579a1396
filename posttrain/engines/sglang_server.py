"""A real SGLang server as a child process: started from SGLang's own environment, health-checked, spoken to over
its native HTTP API, restarted with the current weights if it dies, its log kept in a file.

SGLang never goes into the project venv (its wheel pins a CUDA torch): CPU machines build `.venv-sglang` with
`make sglang` (containers/sglang-cpu/build.sh); GPU machines run the pinned image (containers/gpu-rollout).
`POSTTRAIN_SGLANG_PYTHON` names that environment's python where it is elsewhere."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from posttrain.engines import registry
from posttrain.pipeline.store import home_dir

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "POSTTRAIN_SGLANG_PYTHON"
START_TIMEOUT_S = 300.0
MIN_CONTEXT = 32768  # tokens a request may hold, at least


class ServerError(RuntimeError):
    """The server could not start, or died; the message ends with its own last log lines."""


def sglang_python() -> str:
    """SGLang's environment: POSTTRAIN_SGLANG_PYTHON, else the repo's .venv-sglang."""
    if path := os.environ.get(PYTHON_ENV):
        return path
    local = ROOT / ".venv-sglang" / "bin" / "python"
    if local.is_file():
        return str(local)
    raise ServerError(f"runtime.rollout_engine sglang: no SGLang environment: run `make sglang` (builds .venv-sglang on a "
                      f"CPU machine) or set {PYTHON_ENV} to the python of one (the gpu-rollout image's)")


# Runs the server as its child and stops it when this process is gone, however it went (a Ray actor killed, a
# SIGKILLed stage), so no server outlives its engine. (PR_SET_PDEATHSIG fires when the *thread* that started the
# server ends, which in a Ray actor is long before the actor does.)
WATCHDOG = """
import ctypes, os, signal, subprocess, sys, time
parent = os.getppid()
# the server dies with this watchdog even when it is SIGKILLed (Ray kills a finished worker's children so);
# SGLang's own workers die with the server the same way
server = subprocess.Popen(sys.argv[1:], preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))
signal.signal(signal.SIGTERM, lambda *_: server.terminate())
while server.poll() is None:
    if os.getppid() != parent:
        server.terminate()
        try:
            server.wait(20)
        finally:
            os.killpg(0, signal.SIGKILL)  # the server's own workers too (its detokenizer outlives it otherwise)
    time.sleep(1)
sys.exit(server.wait())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangServer:
    """One `sglang.launch_server` for `checkpoint` on 127.0.0.1; `post` retries nothing itself: `call` restarts a dead
    server once (with the weights it was last given) and repeats the request."""

    def __init__(self, checkpoint: str | Path, *, seed: int = 0, log_dir: str | Path | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.checkpoint, self.seed, self.extra_args = str(checkpoint), seed, extra_args
        self._view = tempfile.TemporaryDirectory(prefix="posttrain-sglang-view-")
        self.served = without_eos(checkpoint, Path(self._view.name))
        if log_dir is None and not (log_dir := os.environ.get(registry.LOG_DIR_VAR)):
            log_dir = home_dir() / "logs" / "sglang"
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"sglang-{os.getpid()}-{time.time_ns()}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.restarts = 0
        self.start()

    def command(self) -> list[str]:
        cuda = torch.cuda.is_available()
        # token in, token out: no tokenizer in the server (so no stop on its EOS either), no detokenising
        python = sglang_python()
        args = [python, "-c", WATCHDOG, python, "-m", "sglang.launch_server", "--model-path", str(self.served),
                "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(self.port),
                "--random-seed", str(self.seed), "--skip-server-warmup", "--log-level", "warning",
                "--sleep-on-idle"]  # else its scheduler spins a core while idle (what a trainer beside it needs)
        # as the torch engine, decode past the trained context (what the long-context suites measure before the
        # ramp); SGLang refuses a request longer than --context-length
        trained = json.loads((Path(self.checkpoint) / "config.json").read_text()).get("max_position_embeddings", 0)
        args += ["--context-length", str(max(trained, MIN_CONTEXT))]
        if "--dtype" not in self.extra_args:  # fp32 as the torch engine (SGLang's "auto" serves fp32 weights in fp16)
            args += ["--dtype", "float32"]
        if not cuda:  # SGLang's CPU path: torch attention and sampling, no graphs
            args += ["--device", "cpu", "--attention-backend", "torch_native",
                     "--sampling-backend", "pytorch", "--disable-cuda-graph", "--grammar-backend", "none",
                     "--mem-fraction-static", "0.05", "--max-total-tokens", "65536"]
        return args + list(self.extra_args)

    def start(self) -> None:
        self.port = _free_port()
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "0" if torch.cuda.is_available() else "1",
               "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
        env.pop("PYTHONPATH", None)  # the project's modules (a different transformers) must not shadow SGLang's
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"SGLang server for {self.checkpoint} exited with {self.proc.returncode} before it "
                                  f"was ready (log {self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet: poll again until the deadline
            time.sleep(0.5)
        self._stop()
        raise ServerError(f"SGLang server for {self.checkpoint} not ready after {START_TIMEOUT_S:.0f} s "
                          f"(log {self.log_path}):\n{self.log_tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def post(self, route: str, payload: dict | None = None, timeout: float = 600.0):
        req = urllib.request.Request(f"{self.url}/{route}", data=json.dumps(payload or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"SGLang /{route}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
        return json.loads(body) if body else None

    def call(self, route: str, payload: dict | None = None, on_restart=None, timeout: float = 600.0):
        """`post`, and if the server died meanwhile: restart it, run `on_restart()` (reload the current weights),
        and send the request again."""
        try:
            return self.post(route, payload, timeout)
        except (urllib.error.URLError, ConnectionError, OSError):
            if self.alive():
                raise
        self.restarts += 1
        print(f"[sglang] the server for {self.checkpoint} died (exit {self.proc.returncode}); restarting "
              f"(log {self.log_path})", flush=True)
        self.start()
        if on_restart is not None:
            on_restart()
        return self.post(route, payload, timeout)

    def close(self) -> None:
        self._stop()
        self._view.cleanup()

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, 9)
                except ProcessLookupError:
                    pass  # the group ended between the two signals: nothing left to kill
                self.proc.wait()
        self.proc = None


def without_eos(checkpoint: str | Path, out: Path) -> Path:
    """`checkpoint` as SGLang should serve it for rollouts: its files linked into `out`, its config and generation
    config copied without `eos_token_id`. SGLang ends a request on the model's EOS ids whatever the request says
    (short of `ignore_eos`, which drops the request's stop ids too); the engine's contract is to stop on the
    caller's stop ids alone."""
    for f in Path(checkpoint).iterdir():
        if f.name in ("config.json", "generation_config.json"):
            cfg = json.loads(f.read_text())
            cfg.pop("eos_token_id", None)
            (out / f.name).write_text(json.dumps(cfg, indent=2))
        else:
            (out / f.name).symlink_to(f.resolve())
    return out
