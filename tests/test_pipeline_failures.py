"""Runs that fail or die on the smoke profile, through the CLI: bad input stops before any work, a failed gate
publishes nothing, and a killed run is closed in MLflow by the next command. Apart from test_pipeline_smoke.py, whose
tests share one run: `make test` runs the two files on its two workers at once. The CLI runs in the test's process
(conftest.run_cli), but for the run killed with its process group: that driver is a process of its own."""
import json
import os
import subprocess
import sys

from mlflow import MlflowClient

from tests.test_pipeline_smoke import ROOT, posttrain


def test_bad_input_fails_before_any_work(tmp_path):
    p = posttrain(tmp_path, "run", "--profile", "smoke-dense", "--set", "rl.stepz=1", check=False)
    assert p.returncode == 2 and "rl.stepz: unknown key" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_failed_gate_fails_the_run_with_a_readable_message(tmp_path):
    raw = tmp_path / "mine.jsonl"
    # good rows first: the up-front check reads the first 1,000 (and refuses a file whose sample is mostly bad,
    # tests/test_curate.py); the input gate in curate sees them all, 60% without text
    raw.write_text("".join('{"id": "%d", "text": "a row of text number %d"}\n' % (i, i) for i in range(1000)) +
                   "".join('{"id": "x%d", "body": "no text field here"}\n' % i for i in range(1500)))
    p = posttrain(tmp_path, "run", "--profile", "smoke-dense", "--set", f"curate.inputs=['{raw}']", check=False)
    assert p.returncode == 1
    assert "stage curate failed" in p.stderr and "gate 'input mine.jsonl' failed" in p.stderr
    assert not list((tmp_path / "artifacts" / "curate").glob("[!.]*"))  # nothing published
    # what finished is kept: the failed node reruns from the failed run's raw corpus
    run = next((tmp_path / "runs").iterdir())
    partial = json.loads((run / "partial.json").read_text())
    assert partial["failed"] and list(partial["stages"]) == ["raw"] and not (run / "report.json").exists()
    again = posttrain(tmp_path, "rerun", "curate", "--from", run.name, check=False)
    assert f"run {run.name} did not finish; reusing the 1 stages it finished" in again.stdout + again.stderr
    assert again.returncode == 1 and "gate 'input mine.jsonl' failed" in again.stderr


def test_a_killed_run_is_marked_killed_in_mlflow_by_the_next_command_and_reruns_from_what_it_finished(tmp_path):
    """kill -9 the driver (and its Ray workers) mid-run: `posttrain report` closes its runs as KILLED, and the
    stages it finished are in its partial.json for `posttrain rerun --from` (written after every wave)."""
    import signal
    import time
    env = {**os.environ, "POSTTRAIN_HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    p = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "run", "--profile", "smoke-dense"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    deadline = time.time() + 300
    partials = tmp_path / "runs"
    while time.time() < deadline and not any('"curate"' in f.read_text() for f in partials.glob("*/partial.json")):
        time.sleep(1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    (run,) = partials.iterdir()
    assert not (run / "report.json").exists()
    assert {"raw", "curate"} <= set(json.loads((run / "partial.json").read_text())["stages"])
    exp = c.get_experiment_by_name("posttrain")
    assert any(r.info.status == "RUNNING" for r in c.search_runs([exp.experiment_id]))
    out = posttrain(tmp_path, "report", check=False)
    assert "marked KILLED" in out.stderr and "no finished run" in out.stderr
    statuses = {r.info.run_name: r.info.status for r in c.search_runs([exp.experiment_id])}
    assert "RUNNING" not in statuses.values() and statuses[next(n for n in statuses if n.startswith("pipeline-"))] == "KILLED"


def test_a_rerun_from_a_failed_main_dag_run_redoes_the_main_dag_after_it_not_the_cross_stage_chains():
    from posttrain.config import load_config
    from posttrain.pipeline.nodes import graph
    from workflows.post_train import rerun_downstream
    g = graph(load_config("smoke-dense"))
    failed = {"failed": True, "workflows": ["post_train"], "stages": {"sft": {}, "rl-reasoning": {}}}
    assert rerun_downstream(g, "rl-general", failed) == {"opd", "quantize", "evaluate"}
    both = {**failed, "workflows": ["post_train", "cross_stage"]}
    assert {"opd", "xs-agentic", "consolidation"} <= rerun_downstream(g, "sft", both)
    assert "xs-agentic" not in rerun_downstream(g, "sft", failed)
    finished = {"stages": {s: {} for s in ("sft", "rl-general", "opd", "quantize", "evaluate")}}
    assert rerun_downstream(g, "rl-general", finished) == {"opd", "quantize", "evaluate"}
