import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class CliResult:
    """What `posttrain *args` left: its exit status and output, as subprocess.CompletedProcess has them."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str):
        self.args, self.returncode, self.stdout, self.stderr = args, returncode, stdout, stderr


class _Fd:
    """A text stream on file descriptor `fd` itself (never closed): sys.stdout/stderr during run_cli, so output from
    any thread, and from a logging handler that keeps the stream it was given, lands wherever the descriptor points."""

    def __init__(self, fd: int):
        self.stream = open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def isatty(self) -> bool:
        return False  # as in a pipe


_FDS: dict[int, _Fd] = {}


def run_cli(args, env: dict | None = None, cwd: str | Path | None = None) -> CliResult:
    """`posttrain *args` in this process: posttrain.cli.main with `env` over the environment, in `cwd` (default the
    repo), its output captured at the file descriptors (Ray's forwarded worker lines, Flyte's and MLflow's logging),
    its exit status from what main returns or raises. It saves a fresh interpreter's ~20 s of imports per call.

    Everything a run changes in the process is put back after it, as if it had been a process of its own: the
    environment (the CLI sets MLFLOW_TRACKING_URI, Ray's variables), the working folder, Ray (shut down, and its log
    handler that posttrain.pipeline.raysupport installs taken off), sys.path, logging, signal handlers, torch's threads, and the
    per-process caches of posttrain (file digests, parsed run configs, opened MLflow stores, uploaded files). Tests
    whose subject is the process itself (SIGKILL, runs racing each other, the installed entry point) keep a
    subprocess."""
    import contextlib
    import logging
    import signal
    import tempfile
    import traceback

    from posttrain.cli import main
    args = [str(a) for a in args]
    saved_env, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    loggers = [logging.root, *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    saved_logging = {lg: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}
    saved_disable = logging.root.manager.disable
    threads = _torch().get_num_threads() if "torch" in sys.modules else None
    for fd in (1, 2):
        _FDS.setdefault(fd, _Fd(fd))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            os.environ.update({"RAY_AUTH_MODE": "disabled", **{k: str(v) for k, v in (env or {}).items()}})
            os.chdir(cwd or ROOT)
            with contextlib.redirect_stdout(_FDS[1]), contextlib.redirect_stderr(_FDS[2]):
                try:
                    code = main(args)
                except SystemExit as e:  # argparse's errors and --help
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, (int, type(None))):
                        print(e.code, file=sys.stderr)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # what a process would print before exiting 1
                    traceback.print_exc()
                    code = 1
                finally:
                    _reset_process()
                    for s in _FDS.values():
                        s.flush()
        finally:
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            sys.path[:] = saved_path  # flyte.init appends the project's root on every call
            for s, handler in saved_signals.items():
                if handler is not None:
                    signal.signal(s, handler)
            for lg in [logging.root, *(v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger))]:
                if lg in saved_logging:
                    lg.level, lg.handlers[:], lg.propagate, lg.disabled = saved_logging[lg]
            logging.disable(saved_disable)
            if threads is not None:
                _torch().set_num_threads(threads)
        out.seek(0)
        err.seek(0)
        return CliResult(["posttrain", *args], code, out.read().decode("utf-8", "replace"),
                         err.read().decode("utf-8", "replace"))


def _torch():
    import torch
    return torch


def _reset_process() -> None:
    """What a CLI call leaves in this process and a fresh one would not have: see run_cli."""
    if "ray" in sys.modules:
        import ray
        if ray.is_initialized():
            ray.shutdown()
        from ray._private import worker as ray_worker
        dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
        if dispatcher is not None:  # posttrain.pipeline.raysupport.route_worker_logs' handler: the next run adds its own
            dispatcher.remove_handler("posttrain_print_logs")
    mods = sys.modules
    if "posttrain.pipeline.artifacts" in mods:
        mods["posttrain.pipeline.artifacts"]._FILE_DIGESTS.clear()
    if "posttrain.pipeline.nodes" in mods:
        mods["posttrain.pipeline.nodes"]._parsed.cache_clear()
    if "posttrain.pipeline.tracking" in mods:
        mods["posttrain.pipeline.tracking"]._OPENED.clear()
    if "posttrain.pipeline.store" in mods:
        mods["posttrain.pipeline.store"]._PUSHED.clear()
    if "posttrain.pipeline.codehash" in mods:
        mods["posttrain.pipeline.codehash"].module_closure.cache_clear()  # by module name (the parsed sources: by content)
    if "mlflow" in mods:
        import mlflow
        while mlflow.active_run():
            mlflow.end_run()


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A small BPE tokenizer with the chat template, saved and reloaded as a serving engine would."""
    import environments
    from transformers import AutoTokenizer

    from posttrain.chat import train_tokenizer
    texts = [t.prompt + " " + str(t.demo) for d in environments.DOMAINS
             for t in environments.get(d).generate("train", 100, 0)]
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 400).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


PARITY_ENV = ("from environments.base import Task, collect, verify_number\n"
              "def generate(split, n, seed, **_):\n"
              "    def make(rng):\n"
              "        x = rng.randint(0, 10**6)\n"
              "        return str(x), Task(id='', domain='parity', split='', prompt=f'Parity of {x}?',\n"
              "                            answer=str(x % 2), demo=[{'role': 'assistant', 'reasoning_content': '',\n"
              "                                                      'content': str(x % 2)}])\n"
              "    return collect('parity', split, n, seed, make)\n"
              "verify = verify_number\n")


@pytest.fixture(autouse=True)
def _no_run_environments():
    """A test that checks a config with its own environments leaves them for the next test's generators, as a run
    leaves them for the next run in its process: forget them, as the next run's check would."""
    yield
    if "environments" in sys.modules:
        sys.modules["environments"].names()


@pytest.fixture
def parity_env(tmp_path, monkeypatch):
    """A user's environment outside the repo: module `parity_env` on sys.path, forgotten after the test."""
    (tmp_path / "parity_env.py").write_text(PARITY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "parity_env"
    sys.modules.pop("parity_env", None)


@pytest.fixture(scope="module")
def megatron_groups():
    """For a module whose tests open the megatron engine's world of one in this process: closed after it, since
    later tests open their own process groups."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_pair():
    """Two warm processes for a module's two-rank tests (tests/gloo_pair.py): `gloo_pair.spawn(fn, args)`. Not kept
    for the session: idle, they would go on polling the sockets of the process groups they closed."""
    from tests.gloo_pair import Pair
    pair = Pair()
    yield pair
    pair.close()


# the longest files first, longest first (seconds on 2 cores, 2026-11-29, beside the other worker; 2026-11-30 on a
# 2-core machine ~4.5x slower: the smoke DAG modules ~40 min of the ~60): under `make test`'s two workers (xdist, a
# file to a worker at a time, in this order: the Makefile's --no-loadscope-reorder keeps xdist from putting the files
# with the most tests first) the smoke-DAG modules run beside the many short files instead of after them, and the two
# workers finish together
LONG = ("test_pipeline_smoke.py",  # 600
        "test_glm5_pipeline.py",  # 170
        "test_pipeline_failures.py",  # 150
        "test_megatron.py",  # 140
        "test_quantize.py", "test_bench_small.py", "test_tracking.py", "test_deploy.py", "test_mtp.py",  # 40-70 each
        "test_megatron_glm5.py", "test_megatron_mtp.py", "test_lm_eval.py", "test_raysupport.py",
        # `make test-slow`'s files, on its two workers the same way (minutes on the slow machine: real_models ~29 with
        # two runs at once, the interpreted Triton kernels ~9, lm-eval's built-in index ~6; on a fast one the small
        # run ~13 with its checkpoint's download and conversion, the megatron DAG file ~9.5, glm5's megatron DAG ~4)
        "test_real_models.py", "test_glm5_determinism.py", "test_pipeline_smoke_more.py", "test_small_run.py",
        "test_megatron_dag.py", "test_triton_interpreted.py", "test_megatron_glm5_dag.py",
        "test_lm_eval_unknown_task.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG)))  # stable: each file's own order is kept
