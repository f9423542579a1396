"""MLflow lineage: one parent run per pipeline run, one child per node, linked by explicit ids.

Run ids are passed explicitly through MlflowClient: MLflow's active-run stack is thread-local, so
siblings started under asyncio.gather would otherwise get the wrong parent.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

from posttrain.pipeline.lease import process_gone

EXPERIMENT = "posttrain"


def server_uri() -> str:
    """The tracking server (or any store MLflow takes) from MLFLOW_TRACKING_URI, which the CLI sets from the
    profile's `tracking.uri` when the environment has none; empty: the local store."""
    return os.environ.get("MLFLOW_TRACKING_URI", "")


def configure(uri: str) -> None:
    """The profile's `tracking.uri`, for this process and the Ray workers it starts (the environment wins)."""
    if uri:
        os.environ.setdefault("MLFLOW_TRACKING_URI", uri)


def tracking_uri(home: str | Path) -> str:
    return server_uri() or f"sqlite:///{Path(home).resolve()}/mlflow.db"


_OPENED: set[str] = set()  # local stores this process has opened (so their tables exist)


def client(home: str | Path) -> MlflowClient:
    uri = tracking_uri(home)

    def make() -> MlflowClient:
        return MlflowClient(tracking_uri=uri, registry_uri=os.environ.get("MLFLOW_REGISTRY_URI") or uri)
    if server_uri() or uri in _OPENED:
        return make()
    # the first open creates and migrates mlflow.db, which is not safe against a second process doing the same:
    # two runs started at once on a fresh home failed with "Online migration expected to match one row when
    # updating ... in 'alembic_version'; 0 found". One process at a time opens it (the tables exist after)
    import fcntl
    Path(home).mkdir(parents=True, exist_ok=True)
    with open(Path(home) / ".mlflow.db.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        c = make()
        c.search_experiments(max_results=1)
        c.search_registered_models(max_results=1)
    _OPENED.add(uri)
    return c


# MLflow 3's UI opens in its GenAI view (an empty Traces page): these are training runs. The tag says so where the
# UI reads it; the UI's GenAI / Model training switch reads the URL parameter (or the browser's last choice)
KIND = {"mlflow.experimentKind": "custom_model_development"}
ML_VIEW = "workflowType=machine_learning"


def experiment_id(c: MlflowClient, home: str | Path) -> str:
    exp = c.get_experiment_by_name(EXPERIMENT)
    if exp:
        if not exp.tags.get("mlflow.experimentKind"):  # a store made before the tag was set
            c.set_experiment_tag(exp.experiment_id, *next(iter(KIND.items())))
        return exp.experiment_id
    try:
        if server_uri():  # artifacts go to the server's artifact store
            return c.create_experiment(EXPERIMENT, tags=KIND)
        return c.create_experiment(EXPERIMENT, artifact_location=(Path(home).resolve() / "mlruns").as_uri(), tags=KIND)
    except Exception:  # created concurrently
        return c.get_experiment_by_name(EXPERIMENT).experiment_id


def start_run(home: str, name: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
    c = client(home)
    if parent_run_id:
        tags = {**tags, "mlflow.parentRunId": parent_run_id}
    return c.create_run(experiment_id(c, home), run_name=name, tags=tags).info.run_id


_BAD = re.compile(r"[^\w\-. :/]")


def metric_name(key: str) -> str:
    """MLflow allows alphanumerics, _ - . space : / in names."""
    return _BAD.sub("_", key.replace("@", "_at_"))


def log_result(home: str, run_id: str, *, params: dict, metrics: dict[str, float],
               history: dict[str, list[float]] | None = None, tags: dict[str, str] | None = None,
               datasets: list[tuple[str, str, str]] = (), files: list[Path] = ()) -> None:
    """Params, final metrics, step curves (batched), input datasets (name, digest, uri), small files."""
    c = client(home)
    now = int(time.time() * 1000)
    ms = [Metric(metric_name(k), float(v), now, 0) for k, v in metrics.items() if isinstance(v, (int, float))]
    for key, xs in (history or {}).items():
        # a curve is a value per step, or (step, value) pairs where it is sampled every few steps
        pts = [x if isinstance(x, (list, tuple)) else (i, x) for i, x in enumerate(xs)]
        ms += [Metric(metric_name(f"curve/{key}"), float(v), now, int(i)) for i, v in pts]
    ps = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
    ts = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
    for i in range(0, max(len(ms), 1), 900):  # the store caps a batch at 1000 metrics
        c.log_batch(run_id, metrics=ms[i:i + 900], params=ps if i == 0 else [], tags=ts if i == 0 else [])
    if datasets:
        inputs = [DatasetInput(Dataset(name=n, digest=d[:36], source_type="local", source=json.dumps({"uri": u})),
                               tags=[InputTag("mlflow.data.context", "input"), InputTag("sha256", d)])
                  for n, d, u in datasets]
        for attempt in range(3):
            try:
                c.log_inputs(run_id, datasets=inputs)
                break
            except Exception as e:
                # MLflow's SQL store looks a dataset up, then inserts it: two runs logging the same artifact at once
                # (a shared home, both at the same node) fail one insert on the unique key; again, it is found
                if attempt == 2 or not re.search("unique constraint|integrityerror", str(e), re.I):
                    raise
                time.sleep(0.2 * (attempt + 1))
    for f in files:
        c.log_artifact(run_id, str(f))


def end_run(home: str, run_id: str, status: str = "FINISHED") -> None:
    client(home).set_terminated(run_id, status=status)


def register_model(home: str, name: str, source: str, run_id: str, tags: dict[str, str]) -> str:
    c = client(home)
    from mlflow.exceptions import MlflowException  # mlflow's exceptions: only when registering
    try:
        c.get_registered_model(name)
    except MlflowException:
        try:
            c.create_registered_model(name, description="posttrain pipeline output; lineage: `posttrain lineage`")
        except MlflowException as e:  # a run finishing beside this one created it first
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    tags = {"posttrain.artifact": source, **tags}  # where lineage finds the artifact and its manifest
    if server_uri():  # a server takes only sources inside a run's artifacts: the model goes to its store
        c.log_artifacts(run_id, source, "model")
        source = f"runs:/{run_id}/model"
    return str(c.create_model_version(name, source=source, run_id=run_id, tags=tags).version)


DRIVER_TAGS = ("posttrain.host", "posttrain.pid")


def driver_tags() -> dict[str, str]:
    """Which process drives a pipeline run: how a later run tells a killed one from one still going."""
    return {"posttrain.host": socket.gethostname(), "posttrain.pid": str(os.getpid())}


def close_killed_runs(home: str | Path) -> list[str]:
    """Pipeline runs left RUNNING by a driver that died (`kill -9`, a lost machine) on this host, with their
    stage runs: marked KILLED. Runs whose driver is alive, or on another host, are left alone. Returns the
    parent run ids closed."""
    if not server_uri() and not (Path(home) / "mlflow.db").exists():
        return []
    c = client(home)
    exp = c.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    running = c.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
    dead = {r.info.run_id for r in running
            if process_gone(r.data.tags.get("posttrain.host", ""), r.data.tags.get("posttrain.pid", ""))}
    closed, frontier = set(), set(dead)
    while frontier:  # the pipeline run, its stage runs, their sub-step runs
        closed |= frontier
        frontier = {r.info.run_id for r in running if r.data.tags.get("mlflow.parentRunId") in frontier} - closed
    for run_id in closed:
        c.set_terminated(run_id, status="KILLED")
    return sorted(dead)
