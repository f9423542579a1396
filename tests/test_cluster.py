"""Against real servers on loopback, started by the test and stopped after it: a Ray cluster of two nodes (a
head with no CPUs and a worker node) does the stages' work, an S3-compatible server (moto) holds the artifact
store (POSTTRAIN_HOME=s3://...), an MLflow tracking server (sqlite backend, its own artifact store) receives
every run, input, artifact and the registered model; then a fresh machine (an empty working directory, an
empty local mirror) reads, audits, reruns and resumes from them."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
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


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until `url` answers; a server that exits or never answers fails the test with its log."""
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"{url} did not come up:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)


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
    _wait_until_up(f"{uri}/health", proc, d / "server.log", 120)
    yield uri, d
    proc.terminate()
    proc.wait(timeout=30)


class S3Proxy:
    """The endpoint every posttrain process and Ray node uses: a TCP forwarder to the moto server (tcp_proxy.py),
    which the test can stop (the S3 server gone) and start again on the same port (back, with its objects)."""

    def __init__(self, port: int, target: int, log: Path):
        self.port, self.target, self.log, self.proc = port, target, log, None

    def start(self, die_on: str = "", after: int = 0) -> None:
        extra = [die_on, str(after)] if die_on else []
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "tcp_proxy.py"), str(self.port),
                                      str(self.target), *extra], stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        _wait_until_up(f"http://127.0.0.1:{self.port}", self.proc, self.log, 30)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    import boto3
    d = tmp_path_factory.mktemp("s3-server")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(d / "server.log", "w"), stderr=subprocess.STDOUT)
    _wait_until_up(f"http://127.0.0.1:{port}", proc, d / "server.log", 60)
    proxy = S3Proxy(_free_port(), port, d / "proxy.log")
    proxy.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",  # the test's own view
                      aws_access_key_id="test", aws_secret_access_key="test")
    s3.create_bucket(Bucket="posttrain-test")
    yield env, s3, proxy
    proxy.stop()
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_cluster(s3_server):
    """`ray start --head --num-cpus 0`, then a worker node joining it, in their own temp dir (short: Ray's
    socket paths have a length limit); stopped by that dir, so no other Ray on the machine is touched. The
    nodes hold the store's credentials, as a cluster's pods do (the stages' work reads and writes the store)."""
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    port = _free_port()
    env = {**os.environ, **s3_server[0], "RAY_AUTH_MODE": "disabled"}
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--disable-usage-stats", f"--temp-dir={temp}"]
    for extra in (["--head", "--num-cpus=0", f"--port={port}", "--include-dashboard=false"],
                  [f"--address=127.0.0.1:{port}", "--num-cpus=2", "--object-store-memory=300000000"]):
        subprocess.run(ray + extra, env=env, check=True, capture_output=True, timeout=180)
    nodes = subprocess.run([sys.executable, "-c", "import json, ray; ray.init(address='127.0.0.1:%d'); "
                            "print(json.dumps([(n['NodeID'], n['Resources'].get('CPU', 0)) for n in ray.nodes() "
                            "if n['Alive']]))" % port], env=env, capture_output=True, text=True, timeout=120)
    workers = [nid for nid, cpus in json.loads(nodes.stdout.strip().splitlines()[-1]) if cpus]
    assert len(workers) == 1, nodes.stdout + nodes.stderr
    yield f"127.0.0.1:{port}", workers[0]
    subprocess.run(["pkill", "-9", "-f", temp], check=False)  # ray stop would stop every Ray on the machine
    shutil.rmtree(temp, ignore_errors=True)


def _cli(args: list[str], env: dict, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_run_on_two_ray_nodes_the_s3_store_and_the_tracking_server(mlflow_server, s3_server, ray_cluster,
                                                                      tmp_path):
    uri, server_dir = mlflow_server
    aws, s3, proxy = s3_server
    address, worker_node = ray_cluster
    mirror = tmp_path / "mirror"
    env = {**os.environ, **aws, "POSTTRAIN_HOME": "s3://posttrain-test/home", "POSTTRAIN_LOCAL": str(mirror),
           "RAY_AUTH_MODE": "disabled", "MLFLOW_TRACKING_URI": uri}
    # two runs at once, as two machines of a team would start them (each its own mirror): one computes each node
    # (conditional PUTs on the lease and the commit), the other waits for it; both models' lineage verifies
    # the specialists this test reads (agentic's stage run, general's resume): the third adds time, not paths
    racing = [subprocess.Popen([sys.executable, "-m", "posttrain.cli", "run", "--profile", "smoke-dense", "--set",
                                "rl.domains=[agentic, general]"], cwd=ROOT,
                               env={**env, "RAY_ADDRESS": address, "POSTTRAIN_LOCAL": str(tmp_path / m)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for m in ("mirror", "mirror-b")]
    outs = [p.communicate(timeout=900)[0] for p in racing]
    assert [p.returncode for p in racing] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "is computing this node now" in "".join(outs)
    assert not (mirror / "mlflow.db").exists() and not (mirror / "mlruns").exists()  # nothing tracked locally
    for version in ("1", "2"):
        audit = _cli(["lineage", f"posttrain-smoke-dense@{version}"], {**env, "POSTTRAIN_LOCAL": str(tmp_path / "m-audit")},
                     ROOT, 300)
        assert audit.returncode == 0 and "lineage verified" in audit.stdout, (audit.stdout + audit.stderr)[-2000:]
    reports = [json.loads(s3.get_object(Bucket="posttrain-test", Key=f"home/runs/{run_id}/report.json")["Body"].read())
               for run_id in (next(line.split()[-1] for line in out.splitlines() if line.startswith("HTML report:"))
                              .split("/")[-2] for out in outs)]
    report = next(r for r in reports if not r["stages"]["sft"]["cached"])  # the run that computed (the other waited)
    keys = {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="posttrain-test")
            for o in page.get("Contents", [])}
    for stage, v in report["stages"].items():  # each artifact in the bucket, committed, its manifest there
        assert v["artifact"].startswith(f"s3://posttrain-test/home/artifacts/{stage}/"), v["artifact"]
        prefix = v["artifact"].removeprefix("s3://posttrain-test/")
        assert f"{prefix}/manifest.json" in keys and f"{prefix.rsplit('/', 1)[0]}/COMMIT" in keys
    assert f"home/runs/{report['run_id']}/report.html" in keys
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    parent = c.get_run(report["mlflow_run_id"])
    exp = parent.info.experiment_id
    children = c.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=100)
    stages = {r.data.tags["posttrain.stage"] for r in children}
    assert {"raw", "curate", "base", "sft", "rl-agentic", "opd", "quantize", "evaluate"} <= stages
    # every stage's work ran on the worker node (the head has no CPUs)
    assert {r.data.tags["ray_node"] for r in children if r.data.tags.get("posttrain.cache_hit") != "true"} == \
        {worker_node}
    sft = next(r for r in children if r.data.tags["posttrain.stage"] == "sft")
    assert sft.inputs.dataset_inputs and "loss_last" in sft.data.metrics
    # artifacts reached the server's artifact store, not the run's home
    assert parent.info.artifact_uri.startswith((server_dir / "artifacts").as_uri())
    assert "report.json" in {f.path for f in c.list_artifacts(parent.info.run_id)}
    name, version = report["registered_model"].split("@")
    mv = c.get_model_version(name, version)  # the registered model's files are in the server's store too
    assert {f.path for f in c.list_artifacts(mv.run_id, "model")} >= {"model/model.safetensors", "model/manifest.json"}

    # a fresh machine: an empty working directory and an empty mirror; everything comes from the servers
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = {**env, "POSTTRAIN_LOCAL": str(tmp_path / "mirror2")}
    shown = _cli(["report", "latest"], fresh, empty, 300)
    latest = json.loads(s3.get_object(Bucket="posttrain-test", Key="home/latest/report.json")["Body"].read())
    assert shown.returncode == 0 and latest["run_id"] in shown.stdout, shown.stderr[-2000:]
    audit = _cli(["lineage", report["registered_model"]], fresh, empty, 300)
    assert audit.returncode == 0 and "raw" in audit.stdout and "lineage verified" in audit.stdout, \
        (audit.stdout + audit.stderr)[-2000:]
    redo = _cli(["rerun", "quantize", "--from", "latest"], fresh, empty)
    assert redo.returncode == 0, (redo.stdout + redo.stderr)[-3000:]

    # a resumable stage killed on one machine resumes on another from the store's snapshot of its scratch
    args = ["rerun", "rl-general", "--from", report["run_id"], "--set", "rl.checkpoint_every=1"]
    killed = _cli(args, {**fresh, "POSTTRAIN_KILL_AT": "rl-general:1"}, empty)
    assert killed.returncode == 1 and "stage rl-general failed" in killed.stderr, killed.stderr[-2000:]
    other = {**env, "POSTTRAIN_LOCAL": str(tmp_path / "mirror4")}  # that machine's local scratch is gone
    resumed = _cli(args, other, empty)
    assert resumed.returncode == 0 and "resuming at step 1 of 2" in resumed.stdout + resumed.stderr, \
        (resumed.stdout + resumed.stderr)[-3000:]
    again = json.loads(s3.get_object(Bucket="posttrain-test", Key="home/latest/report.json")["Body"].read())
    weights = [s3.get_object(Bucket="posttrain-test", Key=r["stages"]["rl-general"]["artifact"]
                             .removeprefix("s3://posttrain-test/") + "/model.safetensors")["Body"].read()
               for r in (report, again)]
    assert weights[0] == weights[1]  # the resumed run's weights are the uninterrupted run's
    # sft too: Ray Train keeps its checkpoints in the store's scratch, so it resumes on another machine as well
    args = ["rerun", "sft", "--from", report["run_id"], "--set", "sft.checkpoint_every=1"]
    killed = _cli(args, {**fresh, "POSTTRAIN_SFT_KILL_AT_STEP": "2"}, empty)
    assert killed.returncode == 1 and "stage sft failed" in killed.stderr, killed.stderr[-2000:]
    resumed = _cli(args, {**env, "POSTTRAIN_LOCAL": str(tmp_path / "mirror5")}, empty)
    assert resumed.returncode == 0 and "resuming at step 2 of 4" in resumed.stdout + resumed.stderr, \
        (resumed.stdout + resumed.stderr)[-3000:]
    again = json.loads(s3.get_object(Bucket="posttrain-test", Key="home/latest/report.json")["Body"].read())
    history = [json.loads(s3.get_object(Bucket="posttrain-test", Key=r["stages"]["sft"]["artifact"]
                                        .removeprefix("s3://posttrain-test/") + "/history.json")["Body"].read())
               for r in (report, again)]
    assert again["stages"]["sft"]["artifact"] != report["stages"]["sft"]["artifact"]
    assert history[0]["loss"] == history[1]["loss"]  # step for step the uninterrupted run's
    assert not any(k.startswith("home/scratch/") for page in
                   s3.get_paginator("list_objects_v2").paginate(Bucket="posttrain-test", Prefix="home/scratch/")
                   for k in [o["Key"] for o in page.get("Contents", [])])  # dropped once published

    # the S3 server gone in the middle of an upload: the stage fails saying so, nothing becomes visible; once it is
    # back, the rerun publishes the artifact it had finished
    def commits() -> set[str]:
        return {k for page in s3.get_paginator("list_objects_v2").paginate(Bucket="posttrain-test",
                                                                           Prefix="home/artifacts/quantize/")
                for k in [o["Key"] for o in page.get("Contents", [])] if k.endswith("/COMMIT")}
    before = commits()
    args = ["rerun", "quantize", "--from", report["run_id"], "--set", "quantize.calib_samples=4"]
    proxy.stop()
    proxy.start(die_on="PUT /posttrain-test/home/artifacts/quantize/", after=2)  # dies on the second file
    cut = _cli(args, fresh, empty)
    assert proxy.proc.wait(timeout=60) == 0  # it did die mid-upload
    out = cut.stdout + cut.stderr
    assert cut.returncode == 1 and "stage quantize failed" in out and "nothing was committed" in out, out[-3000:]
    assert commits() == before
    proxy.start()
    redo = _cli(args, fresh, empty)
    assert redo.returncode == 0, (redo.stdout + redo.stderr)[-3000:]
    (new,) = commits() - before
    latest = json.loads(s3.get_object(Bucket="posttrain-test", Key="home/latest/report.json")["Body"].read())
    assert latest["stages"]["quantize"]["artifact"].startswith(f"s3://posttrain-test/{new.rsplit('/', 1)[0]}/")

    # a corrupted object in the bucket is refused, by name
    opd = report["stages"]["opd"]["artifact"].removeprefix("s3://posttrain-test/")
    s3.put_object(Bucket="posttrain-test", Key=f"{opd}/config.json", Body=b"{}")
    tampered = {**env, "POSTTRAIN_LOCAL": str(tmp_path / "mirror3")}
    audit = _cli(["lineage", report["registered_model"]], tampered, empty, 300)
    assert audit.returncode == 1 and "file config.json has sha256" in audit.stdout, audit.stdout[-2000:]
    redo = _cli(["rerun", "quantize", "--from", report["run_id"]], tampered, empty)
    assert redo.returncode != 0 and "refused its input opd" in redo.stdout + redo.stderr, redo.stdout[-2000:]
