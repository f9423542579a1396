"""The guard's second stage: suspicious calls go to a model judge that sees the episode so far; labelled calls
measure it; a judge below the floors stops the RL stage."""
import json

import pytest
import torch

import environments
from environments import agentic
from environments.guard import judge_prompt, suspicion
from environments.sandbox import BLOCKED_OUTPUT, Workspace, rule_check
from posttrain.judge import ModelJudge, measure


def test_labelled_calls_pass_the_rules_look_suspicious_and_split_disjointly():
    test = agentic.judge_cases("test", 50, 0)
    assert [c["label"] for c in test].count("allow") == 50 and [c["label"] for c in test].count("block") == 50
    for c in test:
        assert rule_check(c["tool"], c["arg"]) is None and suspicion(c["tool"], c["arg"], c["context"])
    key = lambda c: judge_prompt(c["context"], c["tool"], c["arg"])  # noqa: E731
    assert not {key(c) for c in agentic.judge_cases("train", 200, 0)} & {key(c) for c in test}
    assert [key(c) for c in test] == [key(c) for c in agentic.judge_cases("test", 50, 0)]  # reproducible


def test_judge_questions_join_the_sft_data_only():
    tasks = agentic.generate("train", 200, 0, agentic_judge_share=0.2)
    judge = [t for t in tasks if "judge_case" in t.meta]
    assert len(judge) == 40 and all(t.meta["sft_only"] and t.answer in ("allow", "block") for t in judge)
    assert not any("judge_case" in t.meta for t in agentic.generate("test", 50, 0, agentic_judge_share=0.2))
    assert agentic.generate("train", 50, 0) == agentic.generate("train", 50, 0, agentic_judge_share=0.0)


class LabelEngine:
    """Scores the answer turn the labelled set says is right as the likelier one (a perfect judge), by looking
    the question up; counts its calls."""

    def __init__(self, tok, cases, wrong: bool = False):
        self.tokenizer, self.calls = tok, 0
        self.labels = {judge_prompt(c["context"], c["tool"], c["arg"]): c["label"] for c in cases}
        self.allow = tok("allow", add_special_tokens=False)["input_ids"][0]
        self.wrong = wrong

    def score(self, items, mode="sampled"):
        self.calls += 1
        question = self.tokenizer.decode(items[0][0])
        label = next((v for k, v in self.labels.items() if k in question), "block")
        if self.wrong:
            label = "allow" if label == "block" else "block"
        return [[0.0] if (ids[0] == self.allow) == (label == "allow") else [-5.0] for _, ids, _ in items]


def test_measure_reports_precision_recall_and_cost(tok):
    cases = agentic.judge_cases("test", 50, 0)
    perfect = measure(ModelJudge("perfect", engine=LabelEngine(tok, cases)), cases)
    assert perfect["precision"] == perfect["recall"] == 1.0 and perfect["labelled_calls"] == 100
    assert perfect["judge_tokens_per_call"] > 20
    inverted = measure(ModelJudge("inverted", engine=LabelEngine(tok, cases, wrong=True)), cases)
    assert inverted["precision"] == inverted["recall"] == 0.0


def test_a_blocked_call_returns_dummy_output_and_the_episode_goes_on(tok):
    cases = agentic.judge_cases("test", 50, 0)
    engine = LabelEngine(tok, cases)
    judge = ModelJudge("perfect", engine=engine)
    ws = Workspace.create({"data.txt": "1 2", "expected.txt": "3"}, grader="3", judge=judge)
    try:
        ws.context = {"prompt": "Add up the numbers in data.txt.", "calls": []}
        assert ws.call("read", "data.txt") == "1 2" and engine.calls == 0  # nothing suspicious: no judge tokens
        ws.context["calls"].append(("read", "data.txt", "1 2"))
        assert ws.call("read", "expected.txt") == BLOCKED_OUTPUT
        assert ws.blocked[-1]["stage"] == "judge" and "grader_path" in ws.blocked[-1]["reason"]
        assert ws.call("read", "data.txt") == "1 2"
        assert judge.judged == 1 and judge.tokens > 0
    finally:
        ws.close()


def test_a_real_checkpoint_answers_and_an_untrained_one_stops_the_stage(tok, tmp_path):
    """Any chat checkpoint can judge; one that has not learned to (a fresh model) misses the floors, and the RL
    stage refuses to train with it, naming the floors and the way out."""
    from posttrain.config import ModelConfig, load_config
    from posttrain.models.preset import build_model, save_checkpoint
    from posttrain.stages.specialist import checked_judge
    torch.manual_seed(0)
    ck = tmp_path / "sft"
    save_checkpoint(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                            max_position_embeddings=512), tok), tok, ck)
    cases = agentic.judge_cases("test", 50, 0)[:6]
    judge = ModelJudge(str(ck))
    assert {judge.decide(c["context"], c["tool"], c["arg"]) for c in cases} <= {"allow", "block"}
    cfg = load_config("smoke-dense", ["rl.per_domain={agentic: {judge: {checkpoint: sft}}}"])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match="min_precision"):
        checked_judge(cfg, {"sft": str(ck)}, out, "agentic")
    assert json.loads((out / "judge.json").read_text())["labelled_calls"] == 100
    assert checked_judge(cfg, {"sft": str(ck)}, out, "reasoning") == ("", {})  # no judge configured there
    with pytest.raises(ValueError, match="no labelled calls"):
        checked_judge(load_config("smoke-dense", ["rl.judge.checkpoint=sft"]), {"sft": str(ck)}, out, "reasoning")
    assert environments.get("agentic").judge_cases  # the built-in environment supplies them
