"""evaluate's per-checkpoint memo (posttrain/stages/eval_memo.py): what its key covers and what it leaves out, and a
saved result read back naming the run that computed it. The rerun that reuses it end to end: tests/test_pipeline_smoke.py."""
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.pipeline.artifacts import write_manifest
from posttrain.rl import alarms
from posttrain.stages import eval_memo
from posttrain.stages.evaluate import episode_settings


@pytest.fixture
def arts(tmp_path, monkeypatch):
    """An artifact folder with a manifest per stage, and the stage runner's environment (home, MLflow run)."""
    monkeypatch.setenv(alarms.HOME_VAR, str(tmp_path / "home"))
    monkeypatch.setenv(alarms.RUN_VAR, "run-a")
    out = {}
    for name in ("curate", "sft", "rl-agentic"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text(name)
        write_manifest(tmp_path / name, stage=name, parents={}, config_digest="c", code_digest="d", mlflow_run_id="")
        out[name] = str(tmp_path / name)
    return out


def _keys(cfg, arts):
    suites = ("reasoning", "agentic", "agentic:turns")
    return eval_memo.keys(cfg, arts, {ck: (arts[stage], False, 0, {s: episode_settings(cfg, s) for s in suites})
                                      for ck, stage in (("sft", "sft"), ("specialist/agentic", "rl-agentic"))})


def test_rl_settings_the_episodes_do_not_use_leave_the_keys_and_the_ones_they_use_change_them(arts):
    base = _keys(load_config("smoke-dense"), arts)
    assert base == _keys(load_config("smoke-dense", ["rl.lr=1e-3", "rl.per_domain.agentic.group_size=2"]), arts)
    assert base["sft"] != _keys(load_config("smoke-dense", ["rl.per_domain.agentic.max_turns=5"]), arts)["sft"]
    assert base["sft"] != _keys(load_config("smoke-dense", ["eval.max_new_tokens=7"]), arts)["sft"]
    assert base["sft"] != _keys(load_config("smoke-dense", ["seed=3"]), arts)["sft"]


def test_a_changed_checkpoint_changes_only_its_own_key_and_a_saved_result_comes_back_with_its_run(arts):
    cfg = load_config("smoke-dense")
    before = _keys(cfg, arts)
    assert eval_memo.load(before["sft"]) is None
    result = ({"reasoning": 0.5}, {"reasoning": 12.0}, {}, {"seconds": 3.0, "items": {"reasoning": [1.0, 0.0]}})
    eval_memo.save(before["sft"], result)
    scores, tokens, passk, info = eval_memo.load(before["sft"])
    assert (scores, tokens, passk) == result[:3] and info["items"] == result[3]["items"]
    assert info["memo"]["computed_by_run"] == "run-a"
    (Path(arts["rl-agentic"]) / "weights").write_text("trained again")
    write_manifest(Path(arts["rl-agentic"]), stage="rl-agentic", parents={}, config_digest="c",
                   code_digest="d", mlflow_run_id="")
    after = _keys(cfg, arts)
    assert after["sft"] == before["sft"] and after["specialist/agentic"] != before["specialist/agentic"]


def test_outside_a_pipeline_node_nothing_is_kept(arts, monkeypatch):
    monkeypatch.delenv(alarms.HOME_VAR)
    assert _keys(load_config("smoke-dense"), arts) == {} and eval_memo.load(None) is None
    eval_memo.save(None, ({}, {}, {}, {}))  # a no-op
