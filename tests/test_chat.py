
import pytest
from transformers import AutoTokenizer

import environments
from posttrain.chat import render_ids, render_with_mask
from posttrain.stages.sft import conversation


def test_loss_mask_covers_only_assistant_turns(tok):
    task = environments.get("agentic").generate("train", 1, 0)[0]
    ids, mask = render_with_mask(tok, conversation(task, thinking=True))
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "<tool_call>read" in trained and "<think>" in trained and task.answer in trained
    assert "Add up" not in trained  # user turn
    assert task.meta["files"][next(iter(task.meta["files"]))] not in trained  # tool observation


def test_thinking_off_renders_empty_think_block(tok):
    msgs = [{"role": "user", "content": "Compute 1+2."}]
    off = tok.convert_ids_to_tokens(render_ids(tok, msgs, add_generation_prompt=True, enable_thinking=False))
    on = tok.convert_ids_to_tokens(render_ids(tok, msgs, add_generation_prompt=True))
    assert off[-3:] == ["<|assistant|>", "<think>", "</think>"] and on[-1] == "<|assistant|>"


def test_preserve_thinking_keeps_earlier_turns_thinking(tok):
    msgs = [{"role": "user", "content": "Compute 1+2."},
            {"role": "assistant", "reasoning_content": "1+2=3.", "content": "3"},
            {"role": "user", "content": "Compute 2+2."}]
    dropped = tok.decode(render_ids(tok, msgs, add_generation_prompt=True))
    kept = tok.decode(render_ids(tok, msgs, add_generation_prompt=True, preserve_thinking=True))
    assert "1+2=3." not in dropped and "1+2=3." in kept


@pytest.mark.parametrize("thinking,preserve", [(True, False), (False, False), (True, True)])
def test_one_rendering_path_in_every_mode(tok, tmp_path, thinking, preserve):
    """Training ids == what AutoTokenizer.apply_chat_template gives from the saved files, and every point
    where a rollout would start generating is a prefix of them: no re-tokenisation drift between the two."""
    tok.save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for d in environments.DOMAINS:
        for task in environments.get(d).generate("train", 20, 1):
            conv = conversation(task, thinking)
            ids, mask = render_with_mask(tok, conv, enable_thinking=thinking, preserve_thinking=preserve)
            assert ids == list(auto.apply_chat_template(conv, tokenize=True, return_dict=True,
                                                        preserve_thinking=preserve)["input_ids"])
            for k, m in enumerate(conv):
                if m["role"] == "assistant":
                    prompt = render_ids(auto, conv[:k], add_generation_prompt=True, enable_thinking=thinking,
                                        preserve_thinking=preserve)
                    assert ids[:len(prompt)] == prompt
                    # the reply is trained from its first generated token; thinking off, the empty think block
                    # is the prompt's, so it is not a target (a target would teach thinking-on to skip thinking)
                    assert (mask[len(prompt) - 1], mask[len(prompt)]) == (0, 1)


def test_prefix_masks_equal_the_generation_markers_where_both_apply(tok):
    """Our template's `{% generation %}` markers and prefix rendering agree wherever the turn is generated in
    thinking mode (thinking off, the prompt supplies the empty think block, which the markers would train)."""
    for d in environments.DOMAINS:
        for task in environments.get(d).generate("train", 10, 2):
            conv = conversation(task, True)
            marked = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            assert render_with_mask(tok, conv) == (list(marked["input_ids"]), list(marked["assistant_masks"]))
