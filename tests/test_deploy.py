"""`flyte deploy --dry-run` of both workflows, offline: every stage of the graph is deployed, and the RayJob
spec each task serialises names the image, the pod resources and the GPU counts its tasks/ file declares."""
from pathlib import Path

import pytest
import yaml

from posttrain.config import PipelineConfig
from posttrain.pipeline.nodes import graph

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def deployed():
    import flyte
    from google.protobuf.json_format import MessageToDict

    import workflows.cross_stage as cross
    import workflows.post_train as post
    flyte.init_from_config(str(ROOT / "flyte.yaml"))
    specs = {}
    for env in (post.env, cross.env):
        for d in flyte.deploy(env, dry_run=True, version="dry-run-test"):
            for e in d.envs.values():
                for t in e.deployed_entities:
                    tt = t.deployed_task.task_template
                    specs[tt.id.name] = MessageToDict(tt)
    return specs


def test_every_stage_deploys_as_a_rayjob_with_its_image_resources_and_gpus(deployed):
    from workflows.post_train import task_of
    refs = yaml.safe_load((ROOT / "flyte.yaml").read_text())["image"]["image_refs"]
    assert {"post_train.post_train", "post_train.rerun", "cross_stage_workflow.cross_stage"} <= set(deployed)
    for stage in graph(PipelineConfig()).values():
        task = task_of(stage)
        env = task.parent_env()
        spec = deployed[f"{env.name}.{task.func.__name__}"]
        assert spec["type"] == "ray", stage.name
        assert spec["container"]["image"] == refs[env.image.name], stage.name
        cluster, want = spec["custom"]["rayCluster"], env.plugin_config.worker_node_config[0]
        assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # work goes to the workers
        (group,) = cluster["workerGroupSpec"]
        assert int(group["replicas"]) == want.replicas, stage.name
        requests = group["k8sPod"]["podSpec"]["containers"][0]["resources"]["requests"]
        assert requests["cpu"] == want.requests.cpu and requests["memory"] == want.requests.memory, stage.name
        assert requests.get("nvidia.com/gpu", "0") == str(want.requests.gpu or 0), stage.name
    # the GPU stages ask for GPUs, the CPU ones for none
    gpus = {s: deployed[s]["custom"]["rayCluster"]["workerGroupSpec"][0]["k8sPod"]["podSpec"]["containers"][0]
            ["resources"]["requests"].get("nvidia.com/gpu") for s in ("sft.sft", "rl.rl", "curate.curate")}
    assert gpus == {"sft.sft": "8", "rl.rl": "8", "curate.curate": None}
