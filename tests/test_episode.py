"""The step API: token in, token out, consistent with the chat template token for token."""
import dataclasses
import json

import pytest

import environments
from environments.episode import Episode
from posttrain.chat import render_ids
from posttrain.config import load_config


def test_agentic_episode_matches_template_token_for_token(tok):
    task = environments.get("agentic").generate("test", 1, 0)[0]
    full = render_ids(tok, task.messages(with_demo=True))
    ep = Episode(task, tok)
    prompt = ep.reset()
    assert full[: len(prompt)] == prompt
    # the model "acts" with exactly the tokens the template gives its first assistant turn
    end = tok.convert_tokens_to_ids("<|end|>")
    first = full[len(prompt): full.index(end, len(prompt)) + 1]
    step = ep.step(first)
    assert not step.done and tok.decode(step.obs_ids).startswith("<|tool|>" + task.meta["files"][next(iter(task.meta["files"]))])
    so_far = prompt + first + step.obs_ids
    assert full[: len(so_far)] == so_far  # observations appended as ids: no re-tokenisation drift
    final = ep.step(full[len(so_far):])
    assert final.done and final.reward == 1.0
    assert ep.gen_mask.count(0) == len(step.obs_ids)
    assert prompt + ep.ids == full


def test_single_turn_and_wrong_answer(tok):
    task = environments.get("reasoning").generate("test", 1, 0)[0]
    ep = Episode(task, tok)
    ep.reset()
    result = ep.step(tok("<think>x</think>" + str(int(task.answer) + 1) + "<|end|>", add_special_tokens=False)["input_ids"])
    assert result.done and result.reward == 0.0 and "wrong" in result.reason
    with pytest.raises(RuntimeError, match="is over"):
        ep.step([1])


def test_a_user_environment_named_in_the_config(tmp_path, parity_env):
    cfg = load_config("smoke-dense", ["world.environments={parity: parity_env}"])
    assert environments.names(cfg.world.environments)[-1] == "parity"
    from posttrain import data
    from posttrain.stages import curate
    raw, out = tmp_path / "raw", tmp_path / "curated"
    raw.mkdir(), out.mkdir()
    curate.make_raw(cfg, {}, raw)
    curate.run(cfg, {"raw": str(raw)}, out)
    tasks = data.load_tasks(out, "test", "parity")  # curated sets (and so SFT and eval) include it
    assert len(tasks) == cfg.world.n_test
    assert environments.get("parity").verify(tasks[0], tasks[0].answer)[0] == 1.0


def test_export_test_split_as_jsonl(tmp_path):
    from posttrain.cli import main
    out = tmp_path / "agentic-test.jsonl"
    assert main(["export-env", "agentic", "--profile", "smoke-dense", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == load_config("smoke-dense").world.n_test and all(r["split"] == "test" for r in rows)


def _play(ep, full: list[int], tok) -> list[int]:
    """Act as the rendered demonstration does, turn by turn; returns the contexts each turn was generated from."""
    end = tok.convert_tokens_to_ids("<|end|>")
    contexts = [ep.reset()]
    while not ep.done:
        ctx = ep.prompt_ids + ep.ids
        assert full[:len(ctx)] == ctx, "the episode's context left the template's rendering"
        step = ep.step(full[len(ctx): full.index(end, len(ctx)) + 1])
        if not step.done:
            contexts.append(ep.prompt_ids + ep.ids)
    return contexts


def test_turn_level_thinking_is_token_in_token_out(tok):
    """after_tools: the first turn (the tool call) gets the thinking-off generation prompt, the turn that reads the
    tool result thinks; the task's own per-turn list overrides. Each equals the template's rendering of the same
    conversation with those turns' thinking empty, and earlier turns' thinking stays in the context."""
    task = environments.get("agentic").generate("test", 1, 0)[0]
    lazy_first = [task.demo[0] | {"reasoning_content": ""}, *task.demo[1:]]
    full = render_ids(tok, task.messages() + lazy_first)
    ep = Episode(task, tok, thinking_turns="after_tools")
    contexts = _play(ep, full, tok)
    assert ep.reward == 1.0 and ep.prompt_ids + ep.ids == full
    assert tok.decode(contexts[0]).endswith("<|assistant|><think></think>")  # off: supplied by the prompt
    assert tok.decode(contexts[1]).endswith("<|assistant|>")                 # on: the model opens its think block
    per_task = dataclasses.replace(task, meta={**task.meta, "thinking_turns": [True, False]})
    lazy_last = [*task.demo[:-1], task.demo[-1] | {"reasoning_content": ""}]
    full = render_ids(tok, task.messages() + lazy_last)
    ep = Episode(per_task, tok)
    contexts = _play(ep, full, tok)
    assert ep.prompt_ids + ep.ids == full and tok.decode(contexts[1]).endswith("<think></think>")
    first_think = tok("<think>" + task.demo[0]["reasoning_content"] + "</think>", add_special_tokens=False)["input_ids"]
    assert any(contexts[1][i:i + len(first_think)] == first_think for i in range(len(contexts[1])))  # preserved
    with pytest.raises(ValueError, match="thinking_turns"):
        Episode(task, tok, thinking_turns="sometimes").reset()
