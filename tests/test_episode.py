"""The step API: token in, token out, consistent with the chat template token for token."""
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
    cfg = load_config("smoke", ["world.environments={parity: parity_env}"])
    assert environments.names(cfg.world.environments)[-1] == "parity"
    from posttrain import data
    from posttrain.curate import stage as curate
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
    assert main(["export-env", "agentic", "--profile", "smoke", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == load_config("smoke").world.n_test and all(r["split"] == "test" for r in rows)
