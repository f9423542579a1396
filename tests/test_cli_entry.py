"""The installed `posttrain` entry point in a process of its own (the other CLI tests call posttrain.cli.main in the
test's process, conftest.run_cli): it starts, and its help and argument errors answer without importing the heavy
libraries a run needs (torch, transformers, Flyte, Ray, MLflow), in well under a second of imports."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "flyte", "ray", "mlflow", "pandas", "pyarrow")


def entry_point(*args: str, home: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`posttrain *args` through the console script pip installed, and the top-level packages it imported."""
    exe = Path(sys.executable).with_name("posttrain")
    # `make install` installs the project, entry point included: its absence is the defect this file exists to catch
    assert exe.exists(), f"no installed entry point beside {sys.executable} (pip install -e .)"
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "PYTHONPROFILEIMPORTTIME": "1"}
    p = subprocess.run([str(exe), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in p.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    p.stderr = "\n".join(line for line in p.stderr.splitlines() if not line.startswith("import time:"))
    return p, imported


def test_help_lists_the_subcommands_without_heavy_imports(tmp_path):
    p, imported = entry_point("--help", home=tmp_path)
    assert p.returncode == 0 and "posttrain rerun opd --from latest" in p.stdout
    for cmd in ("run", "rerun", "lineage", "report", "export-env", "lm-eval", "figures", "ui", "checkpoint"):
        assert cmd in p.stdout, cmd
    assert "posttrain" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize("args,message", [
    (["run", "--profile", "smoke-dense", "--sett", "x=1"], "unrecognized arguments: --sett"),
    (["run", "--profile", "smoke-dense", "--set", "rl.stepz=1"], "rl.stepz: unknown key"),
    (["run", "--profile", "smoke-dense", "--force", "sft", "--force", "nosuchstage"], "--force: unknown stage 'nosuchstage'"),
    (["rerun", "nosuchstage", "--from", "latest"], "rerun: unknown stage 'nosuchstage'"),
    (["lineage", "x@abc"], "expected NAME@VERSION"),
], ids=["flag", "key", "force", "rerun", "lineage"])
def test_argument_errors_answer_without_heavy_imports(tmp_path, args, message):
    p, imported = entry_point(*args, home=tmp_path)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert not any(tmp_path.iterdir())  # nothing written to the home
