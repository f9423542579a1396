"""Against real servers on loopback, started by the test and stopped after it: an MLflow tracking server
(sqlite backend, its own artifact store) receives every run, input, artifact and the registered model."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{d}/server.db", "--default-artifact-root",
                             (d / "artifacts").as_uri(), "--workers", "1"],
                            stdout=open(d / "server.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"mlflow server did not start:\n{(d / 'server.log').read_text()[-2000:]}")
            time.sleep(1)
    yield uri, d
    proc.terminate()
    proc.wait(timeout=30)


def test_a_run_is_tracked_on_the_server(mlflow_server, tmp_path):
    uri, server_dir = mlflow_server
    home = tmp_path / "home"
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "RAY_AUTH_MODE": "disabled", "MLFLOW_TRACKING_URI": uri}
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", "--profile", "smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert not (home / "mlflow.db").exists() and not (home / "mlruns").exists()  # nothing tracked locally
    report = json.loads((home / "latest" / "report.json").read_text())
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    parent = c.get_run(report["mlflow_run_id"])
    exp = parent.info.experiment_id
    children = c.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=100)
    stages = {r.data.tags["posttrain.stage"] for r in children}
    assert {"raw", "curate", "base", "sft", "rl-agentic", "opd", "quantize", "evaluate"} <= stages
    sft = next(r for r in children if r.data.tags["posttrain.stage"] == "sft")
    assert sft.inputs.dataset_inputs and "loss_last" in sft.data.metrics
    # artifacts reached the server's artifact store, not the run's home
    assert parent.info.artifact_uri.startswith((server_dir / "artifacts").as_uri())
    assert "report.json" in {f.path for f in c.list_artifacts(parent.info.run_id)}
    name, version = report["registered_model"].split("@")
    mv = c.get_model_version(name, version)  # the registered model's files are in the server's store too
    assert {f.path for f in c.list_artifacts(mv.run_id, "model")} >= {"model/model.safetensors", "model/manifest.json"}
    lineage = subprocess.run([sys.executable, "-m", "posttrain.cli", "lineage", report["registered_model"]],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert lineage.returncode == 0 and "raw" in lineage.stdout, lineage.stderr[-2000:]
