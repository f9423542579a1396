"""The smoke DAG on GLM-5's preset with `runtime.train_engine: megatron`, its experts over two expert-parallel ranks
in every training stage. Apart from test_megatron_dag.py (a run of its own, no shared one): `make test-slow` runs the
files on two workers."""
import json
from pathlib import Path

from mlflow import MlflowClient

from tests.slow.test_megatron_dag import MEGATRON
from tests.test_pipeline_smoke import posttrain

GLM5 = ("--set", "model.arch=glm5", "--set", "ramp.attention=dsa",
        "--set", "ramp.dsa={top_k: 64, warmup_steps: 2, kl_queries: 16}", "--set", "model.num_layers=2",
        "--set", "model.indexer_types=[full, shared]", "--set", "megatron.ep=2", "--set", "sft.workers=2",
        "--set", "rl.routing_replay=true", "--set", "megatron.distributed_optimizer=true",
        "--set", "megatron.micro_batches=2")


def test_the_glm5_preset_trains_through_megatron_with_its_experts_split(tmp_path):
    """GLM-5 in Megatron's latent attention and MoE layers, its experts over two expert-parallel ranks in every
    training stage (the ramp's and sft's Ray Train workers, RL's and OPD's actors), the dense layers' AdamW state split
    over those ranks (the distributed optimizer), sft's batches in two micro-batches, RL under routing replay: the DAG
    publishes, sft logs its expert load and plots it, the bias each step moves leaves sft's checkpoint different from
    the ramp's, and the RL specialist replays its rollouts' routes. The ramp adopts DSA on the model's own indexers
    (a warm-up, then sparse at 64 keys: the 96- and 128-token rungs, and sft's 128-token rows, attend sparsely), and
    its draft (MTP) layer trains beside the ramp's and sft's LM loss, over the micro-batches too."""
    from safetensors.torch import load_file
    posttrain(tmp_path, "run", "--profile", "smoke-dense", *MEGATRON, *GLM5)
    report = json.loads((tmp_path / "latest" / "report.json").read_text())
    assert {"ramp", "sft", "rl-reasoning", "opd", "quantize", "evaluate"} <= set(report["stages"])
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    for stage in ("ramp", "sft", "rl-reasoning", "opd"):
        params = c.get_run(report["stages"][stage]["mlflow_run_id"]).data.params
        assert json.loads(params["runtime.train_engine"]) == "megatron", stage
    for stage in ("ramp", "sft"):  # the draft (MTP) layer trained beside the LM loss (the ramp's: per rung)
        metrics = c.get_run(report["stages"][stage]["mlflow_run_id"]).data.metrics
        assert any(k.endswith("mtp_loss_last") for k in metrics), stage
    sft = Path(report["stages"]["sft"]["artifact"])
    assert "moe_cv_last" in c.get_run(report["stages"]["sft"]["mlflow_run_id"]).data.metrics
    assert (sft / "expert_load.png").is_file()
    assert c.get_run(report["stages"]["rl-reasoning"]["mlflow_run_id"]).data.metrics["curve/routes_replayed"] > 0
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    ramp, base = (Path(report["stages"][s]["artifact"]) for s in ("ramp", "base"))
    before = load_file(ramp / "model.safetensors")[bias]
    assert (load_file(sft / "model.safetensors")[bias] - before).abs().max() > 0
    assert json.loads((ramp / "config.json").read_text())["index_topk"] == 64  # the indexers trained, then kept
    indexer = "model.layers.0.self_attn.indexer.wq_b.weight"
    trained, initial = (load_file(p / "model.safetensors")[indexer] for p in (ramp, base))
    assert (trained - initial).abs().max() > 0
