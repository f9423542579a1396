"""The benchmarks' small mode (BENCH_SMALL=1, bench/__init__.py): its switches, every benchmark importable with a
main(), and the cheap ones run end to end in a fresh folder (`make bench-small` runs them all)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench
from bench.__main__ import names

ROOT = Path(__file__).resolve().parent.parent


def small_env(**extra) -> dict:
    return {**os.environ, "BENCH_SMALL": "1", "PYTHONPATH": str(ROOT), **extra}


def test_small_mode_switches_sizes_output_folder_and_marks(monkeypatch):
    monkeypatch.delenv("BENCH_SMALL", raising=False)
    assert not bench.small() and bench.size(200, 8) == 200 and bench.mark({"a": 1}) == {"a": 1}
    assert bench.out_dir() == Path(".posttrain/bench") and bench.threads(2) == 2
    monkeypatch.setenv("BENCH_SMALL", "0")
    assert not bench.small()
    monkeypatch.setenv("BENCH_SMALL", "1")
    assert bench.small() and bench.size(200, 8) == 8 and bench.mark({"a": 1}) == {"small": True, "a": 1}
    assert bench.out_dir() == Path(".posttrain/bench-small") and bench.threads(2) == 1


def test_a_missing_peer_is_a_note_in_small_mode_and_an_error_at_full_size(monkeypatch, capsys):
    monkeypatch.setenv("BENCH_SMALL", "1")
    assert not bench.peer("no_such_peer_library", "x")
    assert "no_such_peer_library is not installed" in capsys.readouterr().out
    assert bench.peer("json", "x")
    monkeypatch.setenv("BENCH_SMALL", "0")
    with pytest.raises(SystemExit, match="install the bench extra"):
        bench.peer("no_such_peer_library", "x")


def test_every_benchmark_imports_in_small_mode_with_a_main():
    code = ("import importlib, sys\n"
            "from bench.__main__ import names\n"
            "bad = [n for n in names() if not callable(getattr(importlib.import_module('bench.' + n), 'main', None))]\n"
            "sys.exit(str(bad) if bad else 0)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=small_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert {"sft", "ramp", "cuda_shapes", "store"} <= set(names())


def test_the_cheap_benchmarks_run_in_small_mode_and_write_their_marked_json(tmp_path):
    # seconds each, none needing the smoke run (SMOKE_RUN) some others start from; `make bench-small` runs them all
    cheap = ["ramp", "cuda_shapes", "cpu_bf16", "megatron_memory"]
    p = subprocess.run([sys.executable, "-m", "bench", *cheap], cwd=tmp_path, env=small_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    fig = json.loads((tmp_path / ".posttrain/bench-small/ramp.json").read_text())
    assert fig["small"] is True and fig["seq_lens"] == [64, 128] and None in fig["tokens_per_s_padded"]
    assert not (tmp_path / ".posttrain/bench").exists()  # the full figures are never overwritten
    assert all(f"== bench {name}" in p.stdout for name in cheap)
