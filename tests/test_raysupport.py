"""Stage tasks on Ray: a stage's own variables stay its own although its worker serves the next stage."""
import os
import threading
import time

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
    raysupport.start_local(num_cpus=1, include_dashboard=False, object_store_memory=128 << 20,
                           configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
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
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # this module's Ray stays up for the tests after
    raysupport.start_local(num_cpus=1)
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
        raysupport.start_local(num_cpus=1)
    assert len(calls) == 1


def _gated(**options):
    """An actor class built once the file `until` exists (defined here, so Ray ships it by value: this test module
    is not importable in every worker)."""
    class Gated:
        def __init__(self, until: str | None = None):
            while until and not os.path.exists(until):
                time.sleep(0.1)

        def ready(self) -> bool:
            return True
    return ray.remote(Gated).options(**options)


def test_an_actor_placed_but_slow_to_build_is_waited_for(local_ray, tmp_path):
    """A rollout worker that a node took but that builds for longer than the placement deadline (a busy machine
    loading its checkpoint) is waited for, not reported as unschedulable."""
    go = tmp_path / "go"
    actor = _gated(num_cpus=0).remote(str(go))
    deadline = time.monotonic() + 120
    while not raysupport._placed(actor):  # a node took it: its constructor now waits for `go`
        assert time.monotonic() < deadline, "Ray did not place a 0-CPU actor in 120 s"
        time.sleep(0.2)
    threading.Timer(8, go.touch).start()  # after the placement deadline (0 s) was checked at least once
    raysupport.wait_for_actors([actor], "gated actor(s)", "unused", place_s=0)
    assert go.exists()


def test_an_actor_no_node_can_take_fails_naming_the_fix(local_ray):
    actor = _gated(num_cpus=2).remote()  # the fixture's Ray has 1 CPU
    with pytest.raises(RuntimeError, match=r"1 rollout worker\(s\) of 2 CPU could not be scheduled in 2 s: raise"):
        raysupport.wait_for_actors([actor], "rollout worker(s) of 2 CPU", "raise runtime.ray_num_cpus", place_s=2)
    ray.kill(actor)
