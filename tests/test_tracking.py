"""The local MLflow store under concurrent first use."""
import multiprocessing as mp


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
