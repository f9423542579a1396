"""Self-distillation replay for sft (posttrain/replay.py): its prompts, its examples, its share of the mixture."""
import json
import re

import pytest

from environments import chat
from posttrain import replay
from posttrain.chat import ChatFormatError, chat_format, render_ids
from posttrain.config import ConfigError, load_config
from posttrain.engines import Generation


def _norm(q: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", q.lower()).strip()


def test_builtin_prompts_share_no_question_with_the_held_out_chat_suite():
    held_out = {_norm(q) for q, _ in chat.ITEMS}
    assert len(replay.PROMPTS) >= 90
    assert len(set(replay.PROMPTS)) == len(replay.PROMPTS)
    assert not [p for p in replay.PROMPTS if _norm(p) in held_out]


def test_a_prompt_file_is_read_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Say hi."}\n\n{"prompt": "Name a tree."}\n')
    assert replay.load_prompts(str(good)) == ["Say hi.", "Name a tree."]
    assert replay.load_prompts("") == list(replay.PROMPTS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*non-empty string"):
        replay.load_prompts(str(bad))
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        replay.load_prompts(str(bad))
    bad.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        replay.load_prompts(str(bad))


class _Scripted:
    """An engine answering each prompt with a fixed token list, finished or cut at max_new_tokens."""

    def __init__(self, tok, answers):
        self.tokenizer, self.answers, self.seen = tok, list(answers), []

    def generate(self, prompts, *, max_new_tokens, temperature, stop_ids, generator=None):
        assert temperature == 0.0
        self.seen += prompts
        out = []
        for _ in prompts:
            ids, finished = self.answers.pop(0)
            out.append(Generation(ids[:max_new_tokens], [0.0] * min(len(ids), max_new_tokens),
                                  "stop" if finished else "length"))
        return out


def test_examples_train_exactly_the_generated_tokens_and_leave_out_unfinished_answers(tok):
    eot = chat_format(tok).end_of_turn
    answer = tok("Paris is big.", add_special_tokens=False)["input_ids"] + [eot]
    engine = _Scripted(tok, [(answer, True), (answer[:-1] * 9, False), (answer, True)])
    exs, unfinished = replay.examples(engine, ["A?", "B?", "C?"], max_new_tokens=64, batch_size=2)
    assert unfinished == 1 and len(exs) == 2
    head = render_ids(tok, [{"role": "user", "content": "A?"}], add_generation_prompt=True, enable_thinking=False)
    assert engine.seen[0] == head
    ids, mask = exs[0]
    assert ids == head + answer
    assert mask == [0] * len(head) + [1] * len(answer)


def test_mix_gives_the_replay_its_share_of_the_mixture():
    tasks, rep = [("t", 1)] * 80, [("r", 1), ("r", 2), ("r", 3)]
    mixed = replay.mix(tasks, rep, 0.2)
    assert len(mixed) == 100 and sum(m[0] == "r" for m in mixed) == 20
    assert {m for m in mixed if m[0] == "r"} == set(rep)  # every answer is used, repeated evenly
    assert replay.mix(tasks, rep, 0.0) == tasks


def test_sft_stops_when_the_model_finishes_no_replay_answer(tmp_path):
    from tests.chat_fixtures import make_checkpoint

    from posttrain.stages.sft import replay_examples
    base = str(make_checkpoint("chatml", tmp_path / "ckpt"))
    cfg = load_config("smoke-dense", ["sft.replay_share=0.2", "sft.replay_prompts=3", "sft.replay_max_new_tokens=1"])
    with pytest.raises(ChatFormatError, match="finished none of its 3 replay answers"):
        replay_examples(cfg, base)
    assert replay_examples(load_config("smoke-dense", []), base) == ([], 0)  # off by default


def test_replay_share_of_one_is_refused():
    with pytest.raises(ConfigError, match="replay_share"):
        load_config("smoke-dense", ["sft.replay_share=1"])


def test_a_bad_replay_file_fails_before_any_work(tmp_path):
    from posttrain.cli import _check_local_inputs
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    cfg = load_config("smoke-dense", ["sft.replay_share=0.2", f"sft.replay_file={bad}"])
    with pytest.raises(ConfigError, match=r"sft\.replay_file: .*prompts\.jsonl:1"):
        _check_local_inputs(cfg)
