import shutil

import pytest

from posttrain.pipeline import codehash
from posttrain.pipeline.artifacts import ArtifactRef
from posttrain.config import ConfigError, load_config
from posttrain.pipeline.nodes import StageFailed, cache_key, graph

STAGES = graph(load_config("tiny"))


def _copy_tree(tmp_path, monkeypatch):
    for pkg in codehash.PROJECT_PACKAGES:
        shutil.copytree(codehash.ROOT / pkg, tmp_path / pkg)
    monkeypatch.setattr(codehash, "ROOT", tmp_path)
    codehash.module_closure.cache_clear()


def _stage_digests(cfg):
    codehash.module_closure.cache_clear()
    return {s.name: codehash.stage_code_digest(s.fn.split(":")[0], cfg) for s in STAGES.values()}


def _with_envs(cfg, envs):
    return cfg.model_copy(update={"world": cfg.world.model_copy(update={"environments": envs})})


def test_stage_closures_follow_imports():
    rl = codehash.module_closure("posttrain.stages.specialist")
    assert {"posttrain.rl.rollout", "environments.agentic", "environments.sandbox"} <= set(rl)
    curate = codehash.module_closure("posttrain.stages.curate")
    assert not any(m.startswith("posttrain.rl") for m in curate)


def test_changing_a_helper_changes_only_the_stages_that_use_it(tmp_path, monkeypatch):
    _copy_tree(tmp_path, monkeypatch)
    before = {s.name: codehash.code_digest(s.fn.split(":")[0]) for s in STAGES.values()}
    helper = tmp_path / "posttrain" / "rl" / "rollout.py"
    helper.write_text(helper.read_text() + "\n# changed\n")
    codehash.module_closure.cache_clear()
    after = {s.name: codehash.code_digest(s.fn.split(":")[0]) for s in STAGES.values()}
    changed = {s for s in before if before[s] != after[s]}
    assert {"rl-reasoning", "opd", "evaluate"} <= changed
    assert not changed & {"raw", "curate", "base", "sft", "quantize"}  # ramp samples through rollout for its eval
    codehash.module_closure.cache_clear()


def test_editing_a_registered_verifier_changes_every_stage_that_can_load_it(tmp_path, monkeypatch):
    _copy_tree(tmp_path, monkeypatch)
    cfg = load_config("tiny")
    # loaded only by name (environments.get), so no import statement puts it in a closure
    assert not any("environments.reasoning" in codehash.module_closure(s.fn.split(":")[0]) for s in STAGES.values())
    loaders = {s.name for s in STAGES.values() if "environments" in codehash.module_closure(s.fn.split(":")[0])}
    # every stage reaches posttrain.stages.curate (base for load_pretrain_texts, the rest for load_tasks), which calls
    # environments.get: at module granularity all of them can load a verifier
    assert loaders == set(STAGES)
    before = _stage_digests(cfg)
    plain = codehash.stage_code_digest("posttrain.config", cfg)  # a module that never reaches the registry
    verifier = tmp_path / "environments" / "reasoning.py"
    strict = "def verify(task, completion):\n    return verify_number(task, completion.strip())\n"
    verifier.write_text(verifier.read_text().replace("verify = verify_number\n", strict))
    assert strict in verifier.read_text()
    after = _stage_digests(cfg)
    assert {s for s in before if before[s] != after[s]} == loaders
    assert codehash.stage_code_digest("posttrain.config", cfg) == plain
    codehash.module_closure.cache_clear()


def test_user_environment_outside_the_project_is_in_the_key(tmp_path, monkeypatch):
    pkg = tmp_path / "myenvs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("def check(a, b):\n    return a == b\n")
    env = pkg / "counting.py"
    env.write_text("from .helpers import check\n\ndef verify(task, completion):\n    return 1.0, 'ok'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = load_config("tiny")
    cfg = _with_envs(base, {"count": "myenvs.counting"})
    codehash.module_closure.cache_clear()
    closure = codehash.module_closure("myenvs.counting", ("myenvs",))
    assert {"myenvs", "myenvs.counting", "myenvs.helpers"} <= set(closure)
    key = codehash.stage_code_digest("posttrain.stages.specialist", cfg)
    assert key != codehash.stage_code_digest("posttrain.stages.specialist", base)
    env.write_text(env.read_text().replace("1.0", "0.5"))
    assert codehash.stage_code_digest("posttrain.stages.specialist", cfg) != key
    key = codehash.stage_code_digest("posttrain.stages.specialist", cfg)
    (pkg / "helpers.py").write_text("def check(a, b):\n    return a is b\n")  # followed through its imports
    assert codehash.stage_code_digest("posttrain.stages.specialist", cfg) != key
    whole = _with_envs(base, {"all": "myenvs"})
    key = codehash.stage_code_digest("posttrain.stages.specialist", whole)
    (pkg / "extra.py").write_text("X = 1\n")  # imported by nothing: a package may still load it by name
    assert codehash.stage_code_digest("posttrain.stages.specialist", whole) != key

    missing = _with_envs(base, {"gone": "myenvs.nope"})
    with pytest.raises(ConfigError, match=r"world\.environments\.gone.*myenvs\.nope"):
        codehash.stage_code_digest("posttrain.stages.specialist", missing)
    codehash.module_closure.cache_clear()


def test_base_key_hashes_the_init_from_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    base = load_config("tiny")
    cfg = base.model_copy(update={"base": base.base.model_copy(update={"init_from": str(ckpt)})})
    inputs = {"curate": ArtifactRef("curate", "x", "c" * 64)}
    key = cache_key(STAGES["base"], cfg, "code", inputs)
    (ckpt / "model.safetensors").write_bytes(b"\x01" * 65)
    assert cache_key(STAGES["base"], cfg, "code", inputs) != key
    assert cache_key(STAGES["ramp"], cfg, "code", inputs) == cache_key(STAGES["ramp"], base, "code", inputs)

    gone = cfg.model_copy(update={"base": cfg.base.model_copy(update={"init_from": str(tmp_path / "nope")})})
    with pytest.raises(StageFailed, match=r"base\.init_from"):
        cache_key(STAGES["base"], gone, "code", inputs)
