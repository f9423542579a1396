"""End to end on the smoke profile, through the CLI and Flyte's local runner: the contracts a user
relies on (report, MLflow lineage, registry, caching, rerun, digest checks)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CliResult, run_cli
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ["base", "ramped", "sft", "specialist/reasoning", "specialist/agentic", "specialist/general",
               "generalist", "quantized"]


def posttrain(home: Path, *args: str, check: bool = True, env: dict | None = None) -> CliResult:
    """`posttrain *args` on `home`, in this process (conftest.run_cli: a fresh interpreter's imports saved, the
    process's state put back after it)."""
    p = run_cli(args, env={"POSTTRAIN_HOME": str(home), **(env or {})}, cwd=ROOT)
    if check and p.returncode != 0:
        raise AssertionError(f"posttrain {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def at_once(calls: list[tuple], expect: int = 0) -> list[str]:
    """`posttrain *args` for each (home, args) or (home, args, extra environment), all at once (a home may repeat),
    each expected to exit `expect`: their outputs (stdout and stderr together). The first runs in this process
    (run_cli: no second interpreter's imports), each other one in a process of its own, started just before it:
    runs racing each other on one home are what some tests check, and a smoke run keeps 2 cores about two-thirds
    busy, so two share them well."""
    with tempfile.TemporaryDirectory() as d:
        logs = [open(Path(d) / f"{i}.txt", "w+") for i in range(1, len(calls))]  # noqa: SIM115 - closed below
        envs = [{"POSTTRAIN_HOME": str(home), **(extra[0] if extra else {})} for home, _, *extra in calls]
        procs = [subprocess.Popen([sys.executable, "-m", "posttrain.cli", *call[1]], cwd=ROOT,
                                  env={**os.environ, "RAY_AUTH_MODE": "disabled", **env},
                                  stdout=log, stderr=subprocess.STDOUT, text=True)  # a file: a pipe could fill up
                 for call, env, log in zip(calls[1:], envs[1:], logs)]
        here = run_cli(calls[0][1], env=envs[0], cwd=ROOT)
        codes = [here.returncode, *(p.wait(timeout=900) for p in procs)]
        outs = [here.stdout + here.stderr]
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    assert codes == [expect] * len(calls), "\n".join(o[-3000:] for o in outs)
    return outs


def _report_of(out: str) -> dict:
    """The report of the run whose console output is `out`."""
    html = next(line.split()[-1] for line in out.splitlines() if line.startswith("HTML report:"))
    return json.loads((Path(html).parent / "report.json").read_text())


def stage_runs(home: Path, parent: str) -> dict:
    c = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow.db")
    exp = c.get_experiment_by_name("posttrain")
    runs = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'", max_results=100)
    return {r.data.tags["posttrain.stage"]: r for r in runs}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """Two runs started at once on one home (a team sharing a store): the module's tests use the first."""
    home = tmp_path_factory.mktemp("home")
    outs = at_once([(home, ["run", "--profile", "smoke-dense"])] * 2)
    reports = [_report_of(out) for out in outs]
    worker = next(i for i, r in enumerate(reports) if not r["stages"]["sft"]["cached"])  # the one that trained sft
    (home / "console.txt").write_text(outs[worker])
    (home / "console2.txt").write_text(outs[1 - worker])
    (home / "report2.json").write_text(json.dumps(reports[1 - worker]))
    return home, reports[worker]


def test_two_runs_at_once_on_one_home_compute_each_node_once_and_both_verify(first):
    home, report = first
    other = json.loads((home / "report2.json").read_text())
    # whichever run reached a node first computed it, the other took its artifact (after waiting on its lease when
    # they overlapped: how long they overlap depends on the machine's load, so the waiting is tests/test_lease.py's)
    for stage, ref in report["stages"].items():
        assert [ref["cached"], other["stages"][stage]["cached"]].count(False) == 1, stage
    for stage in ("raw", "curate", "sft", "rl-agentic", "opd", "quantize"):
        assert len(_published(home, stage)) == 1, stage  # one publication, shared
    for version in ("1", "2"):
        out = posttrain(home, "lineage", f"posttrain-smoke-dense@{version}").stdout
        assert "lineage verified" in out and "MISSING" not in out


def test_console_shows_progress_but_not_rays_internals(first):
    home, report = first
    console = (home / "console.txt").read_text() + (home / "console2.txt").read_text()  # either run may show a stage
    assert "sft:" in console and "rl-general:" in console  # stage progress still reaches the user
    # piped, as in CI or `make run > log`: no colour codes, no Ray prefixes, no Ray status pages, no dicts
    for internal in ("(TrainController", "(PlacementGroupCleaner", "core_worker.cc", "Reporting training result",
                     "(_call pid=", "\x1b[", "Autoscaler status", "': "):
        assert internal not in console, internal
    assert (home / "runs" / report["run_id"] / "ray.log").exists()  # they went here


def test_report_has_every_checkpoint_and_suite(first):
    home, report = first
    assert set(CHECKPOINTS) == set(report["eval"])
    for ck in CHECKPOINTS:
        suites = report["eval"][ck]
        assert {"reasoning", "agentic", "general", "long_context@64", "long_context@96", "long_context@128"} <= set(suites)
        assert all(0.0 <= v <= 1.0 for v in suites.values())
        assert set(report["tokens"][ck]) == set(suites)
        # each task's score, in the suite's order, for `posttrain figures`' paired intervals
        items = report["items"][ck]
        assert {"reasoning", "agentic", "long_context@128"} <= set(items) <= set(suites)
        assert all(abs(sum(v) / len(v) - suites[s]) <= 2e-4 for s, v in items.items())  # both rounded to 1e-4
    assert (home / "runs" / report["run_id"] / "report.json").exists()
    envs = report["environments"]
    assert set(envs) == {"reasoning", "agentic", "general", "long_context"}
    assert envs["agentic"]["test"] == 8 and envs["agentic"]["train"] == 64
    assert all(e["hack_attempts_blocked"] >= 0 for e in envs.values())
    for s in ("curate", "base", "ramp", "sft", "rl-reasoning", "opd", "quantize", "evaluate"):
        assert len(report["stages"][s]["sha256"]) == 64
    q = report["quantization"]
    assert q["format"].startswith("compressed-tensors") and q["linear_weight_bytes"] < q["linear_weight_bytes_bf16"]
    assert q["bytes_ratio_vs_bf16"] == round(q["linear_weight_bytes"] / q["linear_weight_bytes_bf16"], 4)
    assert q["disk_bytes"] < q["disk_bytes_unquantized"] and q["fresh_process_generated_tokens"] > 0
    assert set(report["pass_at_k"]) == set(CHECKPOINTS) - {"base", "ramped"}
    assert set(report["pass_at_k"]["quantized"]["general:nothink"]) == {"pass@1", "pass@2"}
    page = Path(report["report_html"])
    assert page.parent.name == report["run_id"] and "data:image/png" in page.read_text()
    assert report["gates"] == {"checkpoint": "quantized", "baseline": "generalist", "passed": True, "checks": []}


def test_mlflow_children_lineage_and_registry(first):
    home, report = first
    runs = stage_runs(home, report["mlflow_run_id"])
    assert {"raw", "curate", "base", "ramp", "sft", "rl-reasoning", "rl-agentic", "rl-general", "opd",
            "quantize", "evaluate"} <= set(runs)
    sft = runs["sft"]
    assert "curve/loss" in sft.data.metrics and sft.data.tags["config_digest"] and sft.data.tags["git_sha"]
    assert sft.data.tags["flyte.action"] and sft.data.tags["flyte.run"]
    assert sft.inputs.dataset_inputs  # upstream artifacts logged as input datasets
    # the specialists a run computes run at the same time; the two runs split the three between them (a node one
    # run waited for is a cache hit in the other), so one of them computed at least two
    specialists, overlapped = ("rl-reasoning", "rl-agentic", "rl-general"), []
    for parent in (report["mlflow_run_id"], json.loads((home / "report2.json").read_text())["mlflow_run_id"]):
        children = stage_runs(home, parent)
        spans = [(children[s].info.start_time, children[s].info.end_time) for s in specialists
                 if children[s].data.tags.get("posttrain.cache_hit") != "true"]
        if len(spans) > 1:
            overlapped.append(max(s for s, _ in spans) < min(e for _, e in spans))
    assert overlapped and all(overlapped)
    out = posttrain(home, "lineage", report["registered_model"]).stdout
    assert "raw" in out and "lineage verified" in out


def test_failing_regression_gate_stops_the_run_and_the_registration(first):
    """A second run whose only change is a gate (in no node's key) redoes nothing, and its failed gate stops it."""
    home, _ = first
    p = posttrain(home, "run", "--profile", "smoke-dense", "--set", "gates.min.general=1.01", check=False)
    assert p.returncode == 1
    assert "regression gate failed: quantized scored" in p.stderr and "below gates.min.general = 1.01" in p.stderr
    report = json.loads((home / "latest" / "report.json").read_text())
    assert all(v["cached"] for v in report["stages"].values())
    assert report["gates"]["passed"] is False and "registered_model" not in report
    assert "FAIL" in Path(report["report_html"]).read_text()
    c = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow.db")
    assert c.get_run(report["mlflow_run_id"]).info.status == "FAILED"


def test_rerun_one_node_reuses_upstream_by_digest(first):
    home, report = first
    posttrain(home, "rerun", "opd", "--from", report["run_id"], "--set", "opd.steps=1")
    new = json.loads((home / "latest" / "report.json").read_text())
    assert new["run_id"] != report["run_id"]
    assert new["stages"]["opd"]["sha256"] != report["stages"]["opd"]["sha256"]
    for s in ("sft", "rl-agentic", "quantize"):  # upstream and (not asked) downstream are reused
        assert new["stages"][s]["sha256"] == report["stages"][s]["sha256"]
    # but the reused quantize and evaluate are of the old opd's model: reported stale, not gated, not registered
    assert new["stale"] == ["evaluate", "quantize"] and "gates" not in new and "registered_model" not in new
    runs = stage_runs(home, new["mlflow_run_id"])
    assert set(runs) == {"opd"}


def test_rerun_of_sibling_nodes_redoes_them_together(first):
    """The RL specialists at once (one setting changed for all): both redone, the rest reused and reported stale."""
    home, report = first
    posttrain(home, "rerun", "rl-agentic", "rl-general", "--from", report["run_id"], "--set", "rl.keep=best")
    new = json.loads((home / "latest" / "report.json").read_text())
    assert set(stage_runs(home, new["mlflow_run_id"])) == {"rl-agentic", "rl-general"}
    assert all(not new["stages"][s]["cached"] for s in ("rl-agentic", "rl-general"))
    assert new["stale"] == ["evaluate", "opd", "quantize"]


def test_a_downstream_rerun_scores_only_the_checkpoints_it_changed(first):
    """`rerun quantize --downstream`: evaluate runs again, but only the new export is scored; the others' scores are
    the first run's, and eval.json names the MLflow run that computed them."""
    home, report = first
    posttrain(home, "rerun", "quantize", "--from", report["run_id"], "--set", "quantize.calib_samples=3",
              "--downstream")
    new = json.loads((home / "latest" / "report.json").read_text())
    assert not new["stages"]["evaluate"]["cached"] and new["stages"]["quantize"]["sha256"] != \
        report["stages"]["quantize"]["sha256"]
    old_eval, new_eval = (json.loads((Path(r["stages"]["evaluate"]["artifact"]) / "eval.json").read_text())
                          for r in (report, new))
    first_evaluate = json.loads((Path(report["stages"]["evaluate"]["artifact"]) / "manifest.json").read_text())
    assert "memo" not in new_eval["decoding"]["quantized"]
    for ck in CHECKPOINTS[:-1]:
        assert new_eval["decoding"][ck]["memo"]["computed_by_run"] == first_evaluate["mlflow_run_id"], ck
        assert new_eval["eval"][ck] == old_eval["eval"][ck] and new_eval["items"][ck] == old_eval["items"][ck], ck


def test_tampered_artifact_is_refused_and_lineage_fails(first):
    home, report = first
    sft_dir = Path(report["stages"]["sft"]["artifact"])
    weights = sft_dir / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-8] + b"tampered")
        p = posttrain(home, "rerun", "opd", "--from", report["run_id"], check=False)
        assert p.returncode != 0 and "model.safetensors" in p.stderr
        p = posttrain(home, "lineage", report["registered_model"], check=False)
        assert p.returncode == 1 and "FAILED" in p.stdout
    finally:
        weights.write_bytes(original)


def test_a_corrupted_cache_entry_is_reported_kept_and_recomputed_beside_it(first):
    home, report = first
    opd = Path(report["stages"]["opd"]["artifact"])
    weights = opd / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(bytes([original[0] ^ 1]) + original[1:])
        p = posttrain(home, "run", "--profile", "smoke-dense")
        out = p.stdout + p.stderr
        assert "[opd] a cached version failed verification and is kept as evidence" in out
        assert "model.safetensors" in out
        new = json.loads((home / "latest" / "report.json").read_text())
        assert Path(new["stages"]["opd"]["artifact"]) == opd.with_name(opd.name + ".2")
        assert weights.read_bytes()[1:] == original[1:]  # not overwritten: the evidence stays
        # opd is deterministic: recomputed to the same bytes it keeps its digest (wall-clock figures are outside it),
        # so what follows it is not redone
        assert new["stages"]["opd"]["sha256"] == report["stages"]["opd"]["sha256"]
        assert new["stages"]["quantize"]["cached"] and new["stages"]["evaluate"]["cached"]
        assert "lineage verified" in posttrain(home, "lineage", new["registered_model"]).stdout
    finally:
        weights.write_bytes(original)


def _published(home: Path, stage: str) -> set[str]:
    return {p.name for p in (home / "artifacts" / stage).iterdir() if not p.name.startswith(".")}


# stage -> (its rerun's settings, the variable that SIGKILLs it right after a checkpoint, where it resumes)
KILLS = {"sft": (["sft.checkpoint_every=1"], {"POSTTRAIN_SFT_KILL_AT_STEP": "2"}, "resuming at step 2 of 4"),
         "rl-general": (["rl.checkpoint_every=1"], {"POSTTRAIN_KILL_AT": "rl-general:1"}, "resuming at step 1 of 2"),
         "opd": ([], {"POSTTRAIN_KILL_AT": "opd:1"}, "resuming at step 1 of 2")}


def resume_after_kill(first, stages: list[str]) -> dict:
    """Each of `stages` (KILLS' keys) rerun from the first run and SIGKILLed right after a checkpoint, then rerun
    again: {stage: (what the killed rerun published, the resumed rerun's output and report)}. What is killed is the
    stage's own Ray worker, never the CLI (which reports the failed stage), so the reruns run in this process, one
    after another: each would pay a fresh interpreter's imports and keep 2 cores busy anyway."""
    home, report = first
    args = {stage: ["rerun", stage, "--from", report["run_id"], *(x for kv in KILLS[stage][0] for x in ("--set", kv))]
            for stage in stages}
    before = {stage: _published(home, stage) for stage in stages}
    for stage in stages:
        p = posttrain(home, *args[stage], check=False, env=KILLS[stage][1])
        assert p.returncode == 1 and f"stage {stage} failed" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    published = {stage: _published(home, stage) - before[stage] for stage in stages}
    outs = {stage: posttrain(home, *args[stage]) for stage in stages}
    return {stage: (published[stage], p.stdout + p.stderr, _report_of(p.stdout)) for stage, p in outs.items()}


@pytest.fixture(scope="module")
def resumed(first):
    """sft killed and resumed (RL's and OPD's: tests/slow/test_pipeline_smoke_more.py)."""
    return resume_after_kill(first, ["sft"])


def _resumed_histories(first, resumed, stage: str) -> tuple[dict, dict]:
    """The uninterrupted run's history of `stage` and the resumed one's, after checking that the killed rerun
    published nothing, that the rerun resumed from its checkpoint, and that the resumed weights are the
    uninterrupted run's, byte for byte."""
    home, report = first
    published, out, again = resumed[stage]
    assert not published
    assert KILLS[stage][2] in out
    original, after = Path(report["stages"][stage]["artifact"]), Path(again["stages"][stage]["artifact"])
    assert after != original
    assert (after / "model.safetensors").read_bytes() == (original / "model.safetensors").read_bytes()
    assert not (home / "scratch" / stage).exists() or not any((home / "scratch" / stage).iterdir())
    return tuple(json.loads((d / "history.json").read_text()) for d in (original, after))


def test_sft_resumes_exactly_after_sigkill(first, resumed):
    """SIGKILL the training process (one rank: the stage's own worker) right after its step-2 checkpoint: nothing is
    published; the rerun continues from there and its loss curve is the uninterrupted run's, step for step."""
    before, after = _resumed_histories(first, resumed, "sft")
    assert after["loss"] == before["loss"] and len(after["loss"]) == 4


def test_a_third_train_engine_is_one_module_and_one_registry_line(first, tmp_path, monkeypatch, request):
    """The smoke DAG's ramp, sft and one RL specialist, each run on the first run's inputs, train through an engine
    registered with one line (posttrain.engines.registry): every training step of each goes through it, and each
    stage's own figures say it trained."""
    from posttrain.config import config_from_dict, load_config
    from posttrain.engines import registry
    from ray import shutdown as ray_shutdown

    from posttrain.pipeline.raysupport import ensure_ray
    from posttrain.stages import ramp, sft, specialist
    from tests.counting_engine import CountingEngine as counting
    counting.calls.clear()
    monkeypatch.setitem(registry.TRAIN, "counting",  # the one line
                        registry.Engine("tests.counting_engine:CountingEngine", registry.TRAIN["torch"].can))
    _, report = first
    art = {s: report["stages"][s]["artifact"] for s in ("base", "curate")}
    cfg = config_from_dict({**load_config("smoke-dense").model_dump(mode="json"), "runtime": {
        **load_config("smoke-dense").runtime.model_dump(mode="json"), "train_engine": "counting"}}, "test")
    ensure_ray(cfg.runtime)
    request.addfinalizer(ray_shutdown)  # not left to the next test file in this worker process
    steps = {}
    out = ramp.run(cfg, {"base": art["base"], "curate": art["curate"]}, tmp_path / "ramp")
    steps["ramp"] = sum(cfg.ramp.steps(st) for st in cfg.ramp.stages)
    assert counting.calls["for_lm"] == len(cfg.ramp.stages) and counting.calls["step"] == steps["ramp"]
    assert all(out["metrics"][f"ramp@{st.seq_len}.loss_last"] > 0 for st in cfg.ramp.stages)
    counting.calls.clear()
    out = sft.run(cfg, {"ramp": str(tmp_path / "ramp"), "curate": art["curate"], "base": art["base"]},
                  tmp_path / "sft", scratch=str(tmp_path / "sft-scratch"))
    assert counting.calls["for_lm"] == 1 and counting.calls["step"] == cfg.sft.steps
    assert counting.calls["forward_backward"] == cfg.sft.steps * cfg.sft.grad_accum
    from safetensors.torch import load_file
    before, after = (load_file(tmp_path / s / "model.safetensors") for s in ("ramp", "sft"))
    assert all(k in after for k in before) and any(not (after[k] == before[k]).all() for k in before)  # it trained
    counting.calls.clear()
    out = specialist.run(cfg, {"sft": str(tmp_path / "sft"), "curate": art["curate"]}, tmp_path / "rl",
                         domain="reasoning")
    assert counting.calls["from_checkpoint"] >= 1 and counting.calls["step"] >= cfg.rl.steps
    assert counting.calls["logprob_losses"] >= cfg.rl.steps
    assert (tmp_path / "rl" / "model.safetensors").is_file()
