"""Benchmarks against peers: `python -m bench [NAME]`; each writes .posttrain/bench/<name>.json.

`BENCH_SMALL=1`: every benchmark at a small size (steps, rows, lengths, seeds, repeats), each in well under a
minute on 2 CPU cores (bench/moe takes ~3), every variant still run: a check that the benchmark runs, its figures
meaningless (`make bench-small`; `make test` runs the cheap ones, tests/test_bench_small.py). Small mode writes under .posttrain/bench-small/
(the JSON marked `"small": true`), never over the full figures; a peer library that is not installed (the `bench`
extra) is skipped there with a note; benchmarks that need a CUDA device say so and return; those that start from a
finished `make run` (or bench/dsa's tiny models) start from one smoke-profile run of the pipeline instead, made
once under .posttrain/bench-small/ (`smoke_report()`)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SMALL_ENV = "BENCH_SMALL"
# the smoke run of small mode: one RL specialist (reasoning) instead of three, the DAG's most numerous stages (each
# stage's fixed costs, not its few steps, are most of a smoke run); the benchmarks need no other specialist
SMOKE_SETS = ["rl.domains=[reasoning]"]


def small() -> bool:
    """Whether the benchmarks run at their small size (BENCH_SMALL=1)."""
    return os.environ.get(SMALL_ENV, "") not in ("", "0")


def out_dir() -> Path:
    """Where the benchmarks write: .posttrain/bench, or .posttrain/bench-small in small mode."""
    return Path(".posttrain/bench-small" if small() else ".posttrain/bench")


def size(full, tiny):
    """`tiny` in small mode, else `full`."""
    return tiny if small() else full


def threads(n: int) -> int:
    """Torch threads for a measured run: `n`, or 1 in small mode (on a busy machine, 2 threads that spin-wait for
    each other's cores made a small run 25x slower; small mode's figures mean nothing anyway)."""
    return 1 if small() else n


def mark(fig: dict) -> dict:
    """`fig` with `"small": true` in small mode (first, so a reader sees it)."""
    return {"small": True, **fig} if small() else fig


def children_in_process() -> bool:
    """Whether a benchmark runs its measured runs in its own process rather than one child process each (small
    mode: most of a small child's time would go to starting Python, Ray and its workers)."""
    return small()


def release_ray() -> None:
    """The end of a run that started Ray: shut it down (its own process), or keep it up for the next run in this
    process (small mode; bench/__main__ shuts it down after each benchmark)."""
    if not children_in_process():
        import ray
        ray.shutdown()


def peer(module: str, bench: str) -> bool:
    """Whether the peer library `module` can be imported. In small mode a missing one is a printed note (its side
    is skipped); at full size the benchmark needs it and this says how to install it."""
    if importlib.util.find_spec(module) is not None:
        return True
    if small():
        print(f"bench/{bench}: {module} is not installed (the `bench` extra): its side is skipped in small mode",
              flush=True)
        return False
    raise SystemExit(f"bench/{bench} measures against {module}: install the bench extra (`make bench` does)")


def _smoke_home() -> Path:
    return (out_dir() / "smoke-home").resolve()


def smoke_args() -> list[str]:
    """`posttrain run` arguments of small mode's smoke run (bench/store runs the same on S3)."""
    return ["run", "--profile", "smoke-dense", *(a for kv in SMOKE_SETS for a in ("--set", kv))]


def smoke_report() -> Path:
    """Small mode's stand-in for a finished `make run`: the smoke profile's pipeline run (a few steps per stage, one
    RL specialist: SMOKE_SETS), run once in its own POSTTRAIN_HOME (a local folder) under out_dir(); its report.json
    (stage artifacts under `stages`)."""
    done = _smoke_home() / "bench-report.json"
    if done.exists():
        report = Path(json.loads(done.read_text())["report"])
        if report.exists():
            return report
    home = _smoke_home()
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "RAY_AUTH_MODE": "disabled"}
    print("bench: running the smoke profile's pipeline once (the small mode's checkpoints) ...", flush=True)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", *smoke_args()], env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"the smoke run failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    wall = time.perf_counter() - t
    reports = sorted((home / "runs").glob("*/report.json"), key=lambda f: f.stat().st_mtime)
    if not reports:
        raise RuntimeError(f"the smoke run wrote no report under {home / 'runs'}")
    done.write_text(json.dumps({"report": str(reports[-1]), "wall_s": round(wall, 1)}))
    return reports[-1]


def smoke_wall_s() -> float:
    """The wall seconds of the smoke run's `posttrain run` (smoke_report()), as bench/store times its runs."""
    smoke_report()
    return json.loads((_smoke_home() / "bench-report.json").read_text())["wall_s"]


def smoke_stages() -> dict[str, str]:
    """Stage name -> artifact folder of the smoke run (smoke_report())."""
    return {k: v["artifact"] for k, v in json.loads(smoke_report().read_text())["stages"].items()}


def sft_inputs(bench: str, env: str) -> tuple[str, str]:
    """(sft, curate) artifact folders to start from: the smoke run's in small mode, else those of the run whose
    report.json the variable `env` names (default: the latest `make run`)."""
    if small():
        stages = smoke_stages()
        return stages["sft"], stages["curate"]
    report = Path(os.environ.get(env, ".posttrain/latest/report.json"))
    if not report.exists():
        sys.exit(f"bench/{bench} needs an sft checkpoint: {report} does not exist; run `make run` first")
    stages = json.loads(report.read_text())["stages"]
    return stages["sft"]["artifact"], stages["curate"]["artifact"]
