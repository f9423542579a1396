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
