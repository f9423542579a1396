import shutil

from posttrain import codehash
from posttrain.stages import STAGES


def test_stage_closures_follow_imports():
    rl = codehash.module_closure("posttrain.rl")
    assert {"posttrain.rollout", "environments.agentic", "environments.sandbox"} <= set(rl)
    curate = codehash.module_closure("posttrain.curate")
    assert "posttrain.rl" not in curate and "posttrain.rollout" not in curate


def test_changing_a_helper_changes_only_the_stages_that_use_it(tmp_path, monkeypatch):
    for pkg in codehash.PROJECT_PACKAGES:
        shutil.copytree(codehash.ROOT / pkg, tmp_path / pkg)
    monkeypatch.setattr(codehash, "ROOT", tmp_path)
    codehash.module_closure.cache_clear()
    before = {s.name: codehash.code_digest(s.fn.split(":")[0]) for s in STAGES.values()}
    helper = tmp_path / "posttrain" / "rollout.py"
    helper.write_text(helper.read_text() + "\n# changed\n")
    codehash.module_closure.cache_clear()
    after = {s.name: codehash.code_digest(s.fn.split(":")[0]) for s in STAGES.values()}
    changed = {s for s in before if before[s] != after[s]}
    assert {"rl-reasoning", "opd", "evaluate"} <= changed
    assert not changed & {"raw", "curate", "base", "sft", "quantize"}  # ramp samples through rollout for its eval
    codehash.module_closure.cache_clear()
