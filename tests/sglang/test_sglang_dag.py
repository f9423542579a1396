"""The smoke DAG with `runtime.rollout_engine: sglang` (partial rollouts, the trainer broadcasting each update to
the servers): the RL specialist's rollouts, OPD's teachers and every evaluation go through real SGLang servers, and
none outlives the run."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _servers() -> set[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if "sglang.launch_server" in line}


def test_the_smoke_dag_generates_scores_and_evaluates_through_sglang(tmp_path):
    before = _servers()
    env = {**os.environ, "POSTTRAIN_HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", "--profile", "smoke-dense", "--set",
                        "runtime.rollout_engine=sglang", "--set", "rl.domains=[reasoning]", "--set",
                        "rl.partial_rollouts=true", "--set", "runtime.weight_sync=broadcast"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "latest" / "report.json").read_text())
    assert {"sft", "specialist/reasoning", "generalist", "quantized"} <= set(report["eval"])
    # each stage's servers log under the run's folder: the rollout worker's, OPD's teacher and worker, and one per
    # evaluated unquantized checkpoint
    (run,) = (tmp_path / "runs").iterdir()
    logs = {stage.name: len(list(stage.glob("sglang-*.log"))) for stage in (run / "logs").iterdir()}
    assert logs["rl-reasoning"] >= 1 and logs["opd"] >= 2 and logs["evaluate"] >= 3, logs
    deadline = time.monotonic() + 60  # a server stopping as its owner exits gets its SIGTERM's grace
    while not _servers() <= before and time.monotonic() < deadline:
        time.sleep(1)
    assert _servers() <= before  # every server stopped with its engine
