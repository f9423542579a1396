"""Stage tasks on Ray: a stage's own variables stay its own although its worker serves the next stage."""
import os

import pytest
import ray

from posttrain.pipeline import raysupport


def _env_of_stage_and_actor(name: str) -> tuple[str | None, str | None]:
    """What a stage sees of `name`, and what an actor it starts sees."""
    @ray.remote
    class Probe:
        def get(self) -> str | None:
            return os.environ.get(name)
    probe = Probe.options(**raysupport.actor_options(num_cpus=0)).remote()
    return os.environ.get(name), ray.get(probe.get.remote())


def _env_of_stage_shards(name: str) -> list[str | None]:
    """What the parallel shards of a stage (`map_tasks`) see of `name`: evaluate's servers log where it says."""
    return raysupport.map_tasks(os.environ.get, [(name,), (name,)], "probe", num_cpus=0)


@pytest.fixture(scope="module")
def local_ray():
    here = os.path.dirname(os.path.abspath(__file__))  # the workers import this module's probe
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    ray.shutdown()  # a Ray another test file left in this worker process has not this runtime_env
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=128 << 20, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def test_a_stages_variables_reach_its_actors_and_not_the_next_stage(local_ray):
    fn = f"{__name__}:_env_of_stage_and_actor"
    first = ray.get(raysupport.submit(fn, 1, 1, "POSTTRAIN_TEST_STAGE", env_vars={"POSTTRAIN_TEST_RUN": "r"},
                                      stage_env={"POSTTRAIN_TEST_STAGE": "a"}))
    second = ray.get(raysupport.submit(fn, 1, 1, "POSTTRAIN_TEST_STAGE", env_vars={"POSTTRAIN_TEST_RUN": "r"}))
    run = ray.get(raysupport.submit(fn, 1, 1, "POSTTRAIN_TEST_RUN", env_vars={"POSTTRAIN_TEST_RUN": "r"}))
    assert first == ("a", "a")
    assert second == (None, None)
    assert run == ("r", "r")  # the run's variables reach every stage and its actors


def test_a_stages_variables_reach_its_parallel_shards(local_ray):
    fn = f"{__name__}:_env_of_stage_shards"
    assert ray.get(raysupport.submit(fn, 1, 1, "POSTTRAIN_TEST_STAGE",
                                     stage_env={"POSTTRAIN_TEST_STAGE": "a"})) == ["a", "a"]
    assert ray.get(raysupport.submit(fn, 1, 1, "POSTTRAIN_TEST_STAGE")) == [None, None]


def test_a_local_ray_that_misses_its_startup_deadline_is_started_again(monkeypatch, capsys):
    """Ray gives a new node 30 s to register; on a busy machine a start can miss it. The run starts Ray again, and
    what the failed start had spawned does not linger."""
    import subprocess
    calls, spawned = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            spawned.append(subprocess.Popen(["sleep", "60"]))  # stands for the failed start's raylet
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    raysupport._start_local(num_cpus=1)
    assert calls == [{"num_cpus": 1}] * 2
    assert spawned[0].wait(timeout=10) != 0  # killed, not left to run its 60 s
    assert "starting it again (2/3)" in capsys.readouterr().err


def test_a_local_ray_start_that_fails_otherwise_fails_at_once(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise ValueError("object_store_memory is too small")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="too small"):
        raysupport._start_local(num_cpus=1)
    assert len(calls) == 1
