"""The smoke DAG with `runtime.train_engine: megatron`: the ramp, sft, the RL specialist and OPD train through
megatron-core; sft's Ray Train workers are its ranks (tensor parallel over two of them gives one rank's curve) and
resume exactly after a SIGKILL from their own per-rank state; the ramp's rungs run over context-parallel ranks;
RL and OPD train over tensor-parallel ranks as Ray actors; a draft (MTP) layer trains beside the ramp's and sft's LM
loss throughout. The glm5 preset's megatron DAG is in test_megatron_glm5_dag.py (a file of its own: `make test-slow`
runs the files on two workers)."""
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.test_pipeline_smoke import posttrain, stage_runs

MEGATRON = ("--set", "runtime.train_engine=megatron", "--set", "rl.domains=[reasoning]", "--set", "mtp.depth=1")
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    posttrain(home, "run", "--profile", "smoke-dense", *MEGATRON)
    return home, json.loads((home / "latest" / "report.json").read_text())


def _loss(report: dict, stage: str) -> list[float]:
    return json.loads((Path(report["stages"][stage]["artifact"]) / "history.json").read_text())["loss"]


def test_the_smoke_dag_trains_through_megatron_and_lineage_says_so(run):
    home, report = run
    assert {"sft", "rl-reasoning", "opd", "quantize", "evaluate"} <= set(report["stages"])
    assert set(report["eval"]) >= {"sft", "specialist/reasoning", "generalist", "quantized"}
    c = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow.db")
    for stage in ("ramp", "sft", "rl-reasoning", "opd"):
        params = c.get_run(report["stages"][stage]["mlflow_run_id"]).data.params
        assert json.loads(params["runtime.train_engine"]) == "megatron", stage
    for stage in ("ramp", "sft"):  # the draft (MTP) layer trained beside the LM loss (the ramp's: per rung)
        metrics = c.get_run(report["stages"][stage]["mlflow_run_id"]).data.metrics
        assert any(k.endswith("mtp_loss_last") for k in metrics), stage


def test_sft_on_two_ray_train_workers_at_tp2_gives_one_ranks_curve(run):
    home, report = run
    posttrain(home, "rerun", "sft", "--from", report["run_id"], *MEGATRON, "--set", "megatron.tp=2",
              "--set", "sft.workers=2")
    tp2 = json.loads((home / "latest" / "report.json").read_text())
    assert tp2["stages"]["sft"]["artifact"] != report["stages"]["sft"]["artifact"]
    assert max(abs(a - b) for a, b in zip(_loss(tp2, "sft"), _loss(report, "sft"))) < 1e-5


def test_megatron_sft_resumes_exactly_after_sigkill_from_each_ranks_state(run):
    """tp=2 over two workers: each rank's shards and optimizer moments are in the checkpoint, so the rerun after a
    SIGKILL at step 2 continues the uninterrupted curve step for step."""
    home, report = run
    args = ("rerun", "sft", "--from", report["run_id"], *MEGATRON, "--set", "megatron.tp=2", "--set", "sft.workers=2",
            "--set", "sft.checkpoint_every=1")
    p = posttrain(home, *args, check=False, env={"POSTTRAIN_SFT_KILL_AT_STEP": "2"})
    assert p.returncode == 1 and "stage sft failed" in p.stderr
    p = posttrain(home, *args)
    assert "resuming at step 2 of 4" in p.stdout + p.stderr
    resumed = json.loads((home / "latest" / "report.json").read_text())
    assert max(abs(a - b) for a, b in zip(_loss(resumed, "sft"), _loss(report, "sft"))) < 1e-5


def test_the_ramp_over_two_context_parallel_ranks_gives_one_ranks_curve(run):
    """The second ramp rung over two Ray Train ranks at its own cp=2 (each holding half of every sequence), the first
    at one rank in the stage's process: both follow the one-rank rungs' losses."""
    home, report = run
    posttrain(home, "rerun", "ramp", "--from", report["run_id"], *MEGATRON, "--set",
              "ramp.stages=[{seq_len: 96, tokens: 384, warmup: 1, rope_theta: 20000.0}, "
              "{seq_len: 128, tokens: 512, warmup: 1, rope_theta: 40000.0, cp: 2}]")
    cp2 = json.loads((home / "latest" / "report.json").read_text())
    assert cp2["stages"]["ramp"]["artifact"] != report["stages"]["ramp"]["artifact"]
    c = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow.db")
    got, want = ({f"loss@{st}": [m.value for m in c.get_metric_history(
        stage_runs(home, r["mlflow_run_id"])["ramp"].info.run_id, f"curve/loss_at_{st}")] for st in (96, 128)}
        for r in (cp2, report))
    assert all(len(v) == 2 for v in want.values())  # the smoke ladder: two rungs of two steps
    assert max(abs(a - b) for k in want for a, b in zip(got[k], want[k])) < 1e-5


def test_rl_and_opd_over_two_tensor_parallel_ranks_start_as_one_rank(run):
    """RL and OPD at tp=2: the loop's trainer runs on two Ray actors. They start from the same weights as one rank,
    so the first step's rollouts (rewards) and loss are one rank's; every step runs and the stage publishes."""
    home, report = run
    for stage, key in (("rl-reasoning", "loss"), ("opd", "distill_loss")):
        posttrain(home, "rerun", stage, "--from", report["run_id"], *MEGATRON, "--set", "megatron.tp=2",
                  "--set", "sft.workers=2")
        tp2 = json.loads((home / "latest" / "report.json").read_text())
        assert tp2["stages"][stage]["artifact"] != report["stages"][stage]["artifact"]
        got, want = (json.loads((Path(r["stages"][stage]["artifact"]) / "history.json").read_text())
                     for r in (tp2, report))
        assert len(got[key]) == len(want[key]) == 2
        assert abs(got[key][0] - want[key][0]) < 1e-5, stage
        if "reward" in want:
            assert got["reward"][0] == want["reward"][0]
