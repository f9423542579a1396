"""The `small` profile (a real chat model, SmolLM2-135M-Instruct) and the held-out everyday chat it is scored on."""
import pytest

import environments
from posttrain.config import load_config
from posttrain.stages.evaluate import completion_checkpoints


def test_the_small_profile_validates_and_scores_long_context_only_at_its_ramp_lengths():
    cfg = load_config("small")
    assert cfg.base.init_from == "checkpoint:smollm2-135m-instruct"
    assert cfg.eval_lengths() == [s.seq_len for s in cfg.ramp.stages]  # not the tiny preset's 128
    assert cfg.eval.chat_suite
    # SmolLM2-135M: hidden 576, intermediate 1536; int4 groups must divide both
    assert 576 % cfg.quantize.group_size == 0 and 1536 % cfg.quantize.group_size == 0
    # the user's chat model is scored as chat; only the ramped one, trained on plain text, as completion
    assert completion_checkpoints(cfg) == ("ramped",)
    assert completion_checkpoints(load_config("tiny")) == ("base", "ramped")


def test_the_chat_suite_is_held_out_and_scored_by_whole_words_after_the_thinking():
    chat = environments.get("chat")
    tasks = chat.generate()
    assert len(tasks) >= 40 and len({t.prompt for t in tasks}) == len(tasks)
    with pytest.raises(ValueError, match="held-out only"):
        chat.generate("train")
    paris = next(t for t in tasks if "France" in t.prompt)
    assert chat.verify(paris, "The capital of France is Paris.")[0] == 1.0
    assert chat.verify(paris, "<think>Paris? maybe Lyon</think>\n\nLyon.")[0] == 0.0  # only the answer counts
    legs = next(t for t in tasks if "spider" in t.prompt)
    assert chat.verify(legs, "A spider has 8 legs.")[0] == 1.0
    assert chat.verify(legs, "A spider has 18 legs.")[0] == 0.0  # a whole number, not a digit inside one

