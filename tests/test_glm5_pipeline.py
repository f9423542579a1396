"""The smoke profile's whole DAG, on GLM-5's architecture as the default: every stage, DSA adopted in the ramp, routing
replay in RL and OPD, an MTP draft layer where GLM-5 keeps it, W4A8 as GLM-5 deploys, lineage (the same seed run twice
giving the same numbers: tests/slow/test_glm5_determinism.py)."""
import json

from safetensors import safe_open
from tests.test_pipeline_smoke import posttrain, stage_runs

# the smoke profile is GLM-5's architecture (configs/smoke.yaml); GRPO and PPO, the third specialist adds time, not paths
TWO_SPECIALISTS = ["--set", "rl.domains=[reasoning, agentic]"]


def test_the_smoke_dag_runs_on_glm5_and_deploys_its_experts_in_int4(tmp_path):
    home = tmp_path
    out = posttrain(home, "run", "--profile", "smoke", *TWO_SPECIALISTS).stdout
    run = next(line.split()[-1] for line in out.splitlines() if line.startswith("HTML report:")).split("/")[-2]
    report = json.loads((home / "runs" / run / "report.json").read_text())
    assert set(report["eval"]["quantized"]) == set(report["eval"]["sft"])
    assert "routed experts pack-quantized int4" in report["quantization"]["format"]
    stages = stage_runs(home, report["mlflow_run_id"])
    for stage in ("base", "sft", "rl-reasoning", "opd"):  # every trainer balanced the routers and logged their load
        metrics = stages[stage].data.metrics
        assert {"moe_cv_first", "moe_cv_last", "moe_max_mean_last"} <= set(metrics), stage
    ramp = stages["ramp"].data.metrics  # DSA adopted at the 128-token rung: its indexers warmed up, then selected
    assert {"ramp_at_128.dsa_warmup.indexer_kl_last", "ramp_at_128.topk_recall_last"} <= set(ramp), sorted(ramp)
    # sft goes on training them (frozen, they select from hidden states sft moves): measured, and moved
    assert {"indexer_kl_last", "topk_recall_last"} <= set(stages["sft"].data.metrics)
    from safetensors.torch import load_file
    ramped, sft = (load_file(f"{report['stages'][s]['artifact']}/model.safetensors") for s in ("ramp", "sft"))
    key = next(k for k in ramped if ".indexer." in k and k.endswith("weight"))
    assert not ramped[key].equal(sft[key]), key
    for stage in ("rl-reasoning", "rl-agentic", "opd"):  # the rollouts' experts replayed (agentic: multi-turn, PPO)
        assert "routes_differ_last" in stages[stage].data.metrics, stage
    # what `make figures` holds the GLM-5 default to: balancing in base, replay's effect in each RL specialist
    assert {"moe_cv_first", "moe_cv_last"} <= set(report["moe"]["base"])
    for stage in ("rl-reasoning", "rl-agentic"):
        probe = report["moe"][stage]
        assert 0 <= probe["replay_probe_with"] and 0 <= probe["replay_probe_without"], stage
    quantized = report["stages"]["quantize"]["artifact"]
    with safe_open(f"{quantized}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight_packed" in keys  # int4, one expert at a time
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_scale" in keys  # int8 per channel
    assert "model.layers.0.mlp.gate_proj.weight_scale" in keys and not any("indexer" in k and "scale" in k for k in keys)
    assert "model.layers.2.eh_proj.weight" in keys and not any(k.startswith("mtp.") for k in keys)  # the draft layer
    from posttrain.quant.int_experts import IntExperts
    from posttrain.quant.int_linear import load_compressed
    experts = [m for m in load_compressed(quantized)[0].modules() if isinstance(m, IntExperts)]
    assert len(experts) == 1 and experts[0].grouped_fits  # layer 1's experts: grouped launches on a Triton device
    assert (home / "runs" / run / "expert_load_sft.png").is_file()  # the load plots reach the run's report
    assert "Expert load during rl-agentic" in (home / "runs" / run / "report.html").read_text()
    lineage = posttrain(home, "lineage", "posttrain-smoke@1").stdout
    assert "lineage verified" in lineage and "MISSING" not in lineage
    # a rerun of one node keeps the figures of the nodes it reuses (`posttrain figures` over rerun seeds needs base's)
    posttrain(home, "rerun", "opd", "--from", run, "--set", "opd.keep=best")
    again = json.loads((home / "latest" / "report.json").read_text())
    assert again["run_id"] != run and again["moe"]["base"] == report["moe"]["base"]
    assert "kept_step" in stage_runs(home, again["mlflow_run_id"])["opd"].data.metrics
