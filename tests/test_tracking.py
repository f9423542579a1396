"""The local MLflow store under concurrent first use."""
import multiprocessing as mp

import pytest


def _experiment(home: str) -> str:
    from posttrain.pipeline import tracking
    c = tracking.client(home)
    return tracking.experiment_id(c, home)


def test_runs_starting_at_once_on_a_fresh_home_share_one_store(tmp_path):
    """Each process's first open creates and migrates mlflow.db; unguarded, three at once failed every time on this
    machine ("Online migration expected to match one row ... 0 found", "duplicate column name: step")."""
    for i in range(2):
        home = str(tmp_path / f"home{i}")
        with mp.get_context("spawn").Pool(3) as pool:
            assert len(set(pool.map(_experiment, [home] * 3))) == 1


def test_a_dataset_another_run_inserted_at_the_same_moment_is_logged_on_the_next_try(tmp_path, monkeypatch):
    """MLflow's SQL store looks a dataset up, then inserts it: two runs on one home logging one artifact at once
    failed the second insert with sqlite's IntegrityError (a smoke run of tests/test_pipeline_smoke.py, 2026-12-01)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from posttrain.pipeline import tracking
    home = str(tmp_path)
    real, calls = MlflowClient.log_inputs, []

    def racing(self, run_id, datasets=None, models=None):
        calls.append(run_id)
        if len(calls) == 1:  # what the store raised when the other run's insert landed between lookup and insert
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                                  "datasets.name, datasets.digest")
        return real(self, run_id, datasets=datasets, models=models)
    monkeypatch.setattr(MlflowClient, "log_inputs", racing)
    run = tracking.start_run(home, "evaluate", {})
    tracking.log_result(home, run, params={}, metrics={}, datasets=[("quantize", "ab" * 32, "/x")])
    assert calls == [run, run]
    inputs = tracking.client(home).get_run(run).inputs.dataset_inputs
    assert [d.dataset.name for d in inputs] == ["quantize"]

    def broken(self, run_id, datasets=None, models=None):
        raise MlflowException("the server is down")
    monkeypatch.setattr(MlflowClient, "log_inputs", broken)  # any other failure is not retried: it reaches the run
    with pytest.raises(MlflowException, match="server is down"):
        tracking.log_result(home, run, params={}, metrics={}, datasets=[("sft", "cd" * 32, "/y")])
