"""The DAG as one table: workflows derive their nodes and waves from it, domains come from the config."""
import pytest

from posttrain.config import ConfigError, load_config
from posttrain.pipeline.run import check_domains
from posttrain.pipeline.nodes import downstream, graph, upstream, waves

@pytest.fixture
def parity(parity_env):
    return [f"world.environments={{parity: {parity_env}}}", "rl.domains=[reasoning, agentic, general, parity]"]


def test_waves_are_the_dags_levels():
    g = graph(load_config("tiny"))
    assert waves(g, "post_train") == [["raw"], ["curate"], ["base"], ["ramp"], ["sft"],
                                      ["rl-reasoning", "rl-agentic", "rl-general"], ["opd"], ["quantize"], ["evaluate"]]
    assert waves(g, "cross_stage") == [["xs-agentic", "seq-agentic"], ["xs-general", "seq-general"], ["consolidation"]]
    assert upstream(g, "consolidation") == {"raw", "curate", "base", "ramp", "sft", "rl-reasoning", "rl-agentic",
                                            "rl-general", "opd", "xs-agentic", "seq-agentic", "xs-general",
                                            "seq-general", "consolidation"}
    assert downstream(g, "rl-agentic") == ["rl-agentic", "opd", "quantize", "evaluate", "consolidation"]


def test_a_user_environment_with_rl_gets_specialist_teacher_chain_and_gates(parity):
    from posttrain.stages.consolidation import methods, midway
    from posttrain.pipeline.graph import checkpoints
    from posttrain.pipeline.gates import suite_names
    cfg = load_config("smoke-dense", parity)
    check_domains(cfg)
    g = graph(cfg)
    assert g["rl-parity"].params == (("domain", "parity"),)                     # its specialist
    assert "rl-parity" in g["opd"].inputs                                        # its OPD teacher
    assert {"xs-parity", "seq-parity"} <= set(g["consolidation"].inputs)         # its chain stages, compared
    assert g["xs-parity"].inputs == ("xs-general", "rl-reasoning", "xs-agentic", "curate")
    assert methods(cfg.rl.domains)["cross_stage"] == "xs-parity"                 # the chain now ends with it
    assert midway(cfg.rl.domains)["sequential_rl_after_general"] == "seq-general"
    assert checkpoints(cfg)["specialist/parity"] == "rl-parity"                  # evaluated
    assert {"parity", "parity:nothink"} <= set(suite_names(cfg))                 # and gated (gates.min.parity)
    assert waves(g, "post_train")[5] == ["rl-reasoning", "rl-agentic", "rl-general", "rl-parity"]


def test_one_specialists_settings_leave_the_others_cache_keys_alone(parity):
    base, cfg = load_config("smoke-dense"), load_config("smoke-dense", parity)
    tuned = load_config("smoke-dense", ["rl.per_domain.general.lr=0.1"])
    gb, gc, gt = graph(base), graph(cfg), graph(tuned)
    assert base.digest(*gb["rl-reasoning"].sections) == cfg.digest(*gc["rl-reasoning"].sections)  # a new domain
    assert base.digest(*gb["rl-reasoning"].sections) == tuned.digest(*gt["rl-reasoning"].sections)
    assert base.digest(*gb["rl-general"].sections) != tuned.digest(*gt["rl-general"].sections)
    assert base.digest(*gb["opd"].sections) != cfg.digest(*gc["opd"].sections)  # opd has one more teacher


def test_rl_domains_must_be_environments_of_the_world(parity):
    with pytest.raises(ConfigError, match=r"rl.domains: unknown domains \['parity'\]"):
        check_domains(load_config("smoke-dense", parity[1:]))
    with pytest.raises(ConfigError, match="opd.student"):
        load_config("smoke-dense", ["opd.student=rl-parity"])
    with pytest.raises(ConfigError, match="rl.domains"):
        load_config("smoke-dense", ["rl.domains=[reasoning, reasoning]"])
    one = graph(load_config("smoke-dense", ["rl.domains=[reasoning]"]))
    assert "consolidation" not in one and "rl-agentic" not in one and one["opd"].inputs == ("sft", "curate",
                                                                                              "rl-reasoning")


def test_every_task_binds_its_stages_inputs_by_name():
    from workflows.post_train import bind
    import importlib
    from posttrain.pipeline.artifacts import ArtifactRef
    g = graph(load_config("tiny"))
    for s in g.values():
        mod, name = s.task.split(":")
        task = getattr(importlib.import_module(mod), name)
        refs = {i: ArtifactRef(i, f"/x/{i}", "0" * 64) for i in s.inputs}
        args = bind(s, task, refs)
        flat = {k: v for k, v in args.items() if isinstance(v, ArtifactRef)}
        flat |= next((v for v in args.values() if isinstance(v, dict)), {})
        assert set(flat) == set(s.inputs), s.name
        assert args.get("stage", s.name) == s.name


def test_an_unknown_engine_fails_before_any_work():
    with pytest.raises(ConfigError, match=r"runtime.rollout_engine: unknown engine 'vllm' \(known: sglang, torch\)"):
        check_domains(load_config("smoke-dense", ["runtime.rollout_engine=vllm"]))
    with pytest.raises(ConfigError, match=r"runtime.train_engine: unknown engine 'deepspeed' \(known: megatron, torch\)"):
        load_config("smoke-dense", ["runtime.train_engine=deepspeed"])
    with pytest.raises(ConfigError, match=r"rl.rollout_engine: moved to runtime.rollout_engine"):
        load_config("smoke-dense", ["rl.rollout_engine=sglang"])


def test_a_waves_nodes_run_at_most_parallel_stages_at_once_and_all_to_their_end():
    """runtime.parallel_stages: memory, not CPUs, bounds how many specialists one machine holds; a failed node does
    not stop its siblings, and results come back in the wave's order."""
    import asyncio

    from workflows.post_train import gather_bounded
    running, peak = [0], [0]

    def call(i: int):
        async def go():
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            await asyncio.sleep(0.01)
            running[0] -= 1
            if i == 1:
                raise RuntimeError("node 1 failed")
            return i
        return go
    for limit, expect in ((2, 2), (0, 4)):
        peak[0] = 0
        outs = asyncio.run(gather_bounded([call(i) for i in range(4)], limit))
        assert peak[0] == expect
        assert outs[0] == 0 and isinstance(outs[1], RuntimeError) and outs[2:] == [2, 3]
