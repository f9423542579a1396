"""Any Hugging Face chat template: formats from the checkpoint, loss masks by prefix rendering, token in, token
out through the tool-call formats, and loud failures where a template leaves nothing to train."""
import json

import pytest
import torch
from chat_fixtures import make_tokenizer

import environments
from environments.agentic import parse_tool_call
from environments.episode import Episode
from posttrain.chat import ChatFormatError, chat_format, render_ids, render_with_mask
from posttrain.stages.sft import check_masks, conversation
from posttrain.engines.torch_train import TorchTrainEngine
from posttrain.train import train

FAMILIES = {  # family -> (thinking switch, tool-call format, end-of-turn token)
    "chatml": (True, "hermes", "<|im_end|>"),
    "llama3": (False, "json", "<|eot_id|>"),
}


@pytest.fixture(scope="module", params=["ours", *FAMILIES])
def family_tok(request, tmp_path_factory, tok):
    if request.param == "ours":
        return "ours", tok
    return request.param, make_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_format_comes_from_the_checkpoint(tmp_path, family):
    thinking, tools, end = FAMILIES[family]
    fmt = chat_format(make_tokenizer(family, tmp_path))
    assert fmt.template.startswith(family + ":") and (fmt.thinking, fmt.tool_format) == (thinking, tools)
    tok = make_tokenizer(family, tmp_path)
    assert tok.convert_tokens_to_ids(end) in fmt.stop_ids and fmt.end_of_turn == tok.convert_tokens_to_ids(end)
    assert fmt.pad_id is not None  # llama3 has no pad token: the document end stands in


@pytest.mark.parametrize("thinking", [True, False])
def test_masks_cover_exactly_the_replies(family_tok, thinking):
    """Replies are trained from their first generated token through their end-of-turn token; no prompt, user or
    tool text, and thinking off never the think block the generation prompt supplies. (A Llama-3 tool-call turn
    drops its content, so with thinking off as text it is not what the model would generate: context only.)"""
    family, tok = family_tok
    fmt = chat_format(tok)
    for d in environments.DOMAINS:
        for task in environments.get(d).generate("train", 8, 3):
            conv = conversation(task, thinking)
            ids, mask = render_with_mask(tok, conv, enable_thinking=thinking)
            trained = tok.decode([i for i, m in zip(ids, mask) if m])
            assert task.prompt not in trained and trained.endswith(tok.decode([fmt.end_of_turn]))
            assert task.answer in trained
            assert ("</think>" in trained) == thinking
            starts = {j for j in range(1, len(mask)) if mask[j] and not mask[j - 1]}
            prompts = [render_ids(tok, conv[:k], add_generation_prompt=True, enable_thinking=thinking)
                       for k, m in enumerate(conv) if m["role"] == "assistant"]
            assert starts <= {len(p) for p in prompts if ids[:len(p)] == p}  # targets start where generation would


def test_token_in_token_out_per_tool_format(family_tok):
    """An agentic episode replaying the demonstration's own reply ids: the model's ids plus the observation ids
    the episode appends are exactly the template's rendering of the whole conversation, and the call parses."""
    family, tok = family_tok
    for task in environments.get("agentic").generate("train", 5, 4):
        conv = conversation(task, True)
        ids, mask = render_with_mask(tok, conv, preserve_thinking=True)
        replies, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                replies, cur = replies + [cur], []
        replies += [cur] if cur else []
        ep = Episode(task, tok)
        prompt = ep.reset()
        for r in replies:
            step = ep.step(r)
        n = len(prompt + ep.ids)  # the rendering may go on past the last end-of-turn (ChatML's newline)
        assert prompt + ep.ids == ids[:n] and ep.ids[-1] in chat_format(tok).stop_ids
        assert step.done and step.reward == 1.0 and ep.turns == 2


@pytest.mark.parametrize("text,call", [
    ("<think>x</think><tool_call>read data.txt</tool_call>", ("read", "data.txt")),
    ('<tool_call>\n{"name": "read", "arguments": {"path": "nums.txt"}}\n</tool_call>', ("read", "nums.txt")),
    ('{"name": "read", "parameters": {"path": "list.txt"}}', ("read", "list.txt")),
    ('<think>a</think>{"name": "read", "parameters": "{\\"path\\": \\"a.txt\\"}"}', ("read", "a.txt")),
    ('<tool_call>{"name": "read", "arguments": {"path": </tool_call>', None),
    ("The answer is 4.", None),
])
def test_tool_calls_parse_in_every_format(text, call):
    assert parse_tool_call(text) == call


def test_a_template_without_a_chat_template_fails_naming_the_folder(tmp_path):
    tok = make_tokenizer("chatml", tmp_path)
    tok.chat_template = None
    with pytest.raises(ChatFormatError, match=f"{tmp_path}.*no chat template"):
        chat_format(tok)


def test_sft_stops_when_every_mask_is_empty(tok):
    with pytest.raises(ChatFormatError, match="sft: every loss mask is empty.*posttrain"):
        check_masks([([1, 2, 3], [0, 0, 0])] * 4, tok)
    check_masks([([1, 2, 3], [0, 0, 0]), ([1, 2, 3], [0, 1, 1])], tok)  # one empty conversation is only reported


def test_training_stops_when_the_loss_is_exactly_zero(tok):
    """A mask that is all zeros gives a loss of exactly 0: the loop stops, naming the node and the hint."""
    from posttrain.config import ModelConfig
    from posttrain.models.preset import build_model
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "loss_mask": torch.zeros(2, 8)}
    with pytest.raises(RuntimeError, match="sft: the loss was exactly 0.*chat template chatml"):
        train(TorchTrainEngine.for_lm(model, lr=1e-3), lambda i: batch, steps=5, lr=1e-3, warmup=0, desc="sft",
              zero_loss_hint="chat template chatml")


def test_report_names_each_checkpoints_chat_format(family_tok):
    family, tok = family_tok
    summary = chat_format(tok).summary()
    assert json.loads(json.dumps(summary)) == summary and set(summary) == {"template", "thinking", "tool_format"}


class _Babbler:
    """A rollout engine that never ends a turn (or, with `stop_on`, ends the prompts of that index on a stop id)."""
    version = 0

    def __init__(self, tok, stop_on: int | None = None):
        self.tokenizer, self.stop_on = tok, stop_on
        self.stats: dict[str, float] = {}

    def close(self) -> None:
        """Nothing to release: a scripted test double in this process."""

    def generate(self, prompts, *, max_new_tokens, temperature, stop_ids, generator=None):
        from posttrain.engines.base import Generation
        word = self.tokenizer.convert_tokens_to_ids("a")
        return [Generation([word] * (max_new_tokens - 1) + [min(stop_ids)], [0.0] * max_new_tokens, "stop")
                if i == self.stop_on else Generation([word] * max_new_tokens, [0.0] * max_new_tokens, "length")
                for i in range(len(prompts))]


def test_rollouts_stop_on_a_stop_token_mismatch(monkeypatch, tok):
    """A batch where no episode ever ends a turn on a stop id stops the rollout, naming the template and its stop
    ids; one episode that stops is enough to go on; the check is off unless asked for."""
    import posttrain.rl.workers as workers
    tasks = environments.get("reasoning").generate("train", 2, 0)
    for stop_on, fails in ((None, True), (1, False)):
        monkeypatch.setattr(workers, "rollout_engine", lambda name, ckpt, *a, **kw: _Babbler(tok, stop_on))
        worker = workers.RolloutWorker("unused")
        if fails:
            with pytest.raises(ChatFormatError, match=r"none of 4 episodes ended a turn on a stop id within 6 new "
                                                      r"tokens \(template posttrain, stop ids \d+ '<\|end\|>'"):
                worker.rollout(tasks, 2, seed=0, max_new_tokens=6, stop_check=True)
            assert worker.rollout(tasks, 2, seed=0, max_new_tokens=6)[1]["episodes"] == 4  # unchecked
        else:
            samples, _ = worker.rollout(tasks, 2, seed=0, max_new_tokens=6, stop_check=True)
            assert len(samples) == 4
