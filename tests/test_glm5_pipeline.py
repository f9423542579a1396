"""The smoke profile's whole DAG, on GLM-5's architecture as the default: every stage, DSA adopted in the ramp, routing
replay in RL and OPD, an MTP draft layer where GLM-5 keeps it, W4A8 as GLM-5 deploys, lineage; and the synchronous
path's determinism (the reason `posttrain figures` over seeds means something: the same seed gives the same numbers)."""
import json
from pathlib import Path

import pytest
from safetensors import safe_open
from tests.test_pipeline_smoke import at_once, posttrain, stage_runs

# the smoke profile is GLM-5's architecture (configs/smoke.yaml); GRPO and PPO, the third specialist adds time, not
# paths. Synchronous (no staleness), so that two runs of one seed can be compared
SYNC_TWO_SPECIALISTS = ["--set", "rl.domains=[reasoning, agentic]", "--set", "rl.max_staleness=0",
                        "--set", "opd.max_staleness=0"]


@pytest.fixture(scope="module")
def twice(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The same seed run twice at once on two fresh homes, `a` and `b` under one folder: (that folder, both reports)."""
    root = tmp_path_factory.mktemp("glm5")
    at_once([(root / name, ["run", "--profile", "smoke", *SYNC_TWO_SPECIALISTS]) for name in "ab"])
    a, b = (json.loads((root / name / "latest" / "report.json").read_text()) for name in "ab")
    return root, a, b


def _weights(report: dict) -> dict[str, str]:
    """Each stage's weight digests, from its manifest."""
    out = {}
    for stage, v in report["stages"].items():
        files = dict(json.loads((Path(v["artifact"]) / "manifest.json").read_text())["files"])
        out.update({f"{stage}/{k}": d for k, d in files.items() if k.endswith(".safetensors")})
    return out


def test_synchronous_path_gives_the_same_report_twice(twice):
    """Same seed, same machine, rl.max_staleness=0 and opd.max_staleness=0, two fresh homes: every score,
    every generated-token count and every stage's weights are identical, so `posttrain figures` over the two
    runs shows no spread. (Timings differ, and so do run ids.) The routing is part of it: the routers' weights and
    biases, and each stage's expert-load and replay figures, over GRPO and PPO's multi-turn episodes."""
    root, a, b = twice
    for key in ("eval", "tokens", "pass_at_k", "moe"):
        assert a[key] == b[key], key
    assert "replay_probe_with" in a["moe"]["rl-agentic"]
    assert _weights(a) == _weights(b) and len(_weights(a)) >= 8  # base, ramp and its 2 rungs, sft, rl, opd, quantize
    runs = [str(root / n / "runs" / r["run_id"]) for n, r in zip("ab", (a, b))]
    posttrain(root / "figures", "figures", "--runs", *runs)
    f = json.loads((root / "figures" / "figures.json").read_text())
    assert f["seeds"] == [0, 0]
    assert all(v["min"] == v["max"] for suites in f["eval"].values() for v in suites.values())
    assert (root / "figures" / "figures.md").read_text().startswith("# figures: profile smoke, seeds")


def test_the_smoke_dag_runs_on_glm5_and_deploys_its_experts_in_int4(twice):
    root, report, _ = twice
    home, run = root / "a", report["run_id"]
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
