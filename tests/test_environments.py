import pytest

import environments
from environments import general, reasoning


@pytest.mark.parametrize("name", ["reasoning", "agentic", "general", "long_context"])
def test_generators_are_deterministic_and_splits_disjoint(name):
    env = environments.get(name)
    a = env.generate("train", 50, seed=3)
    b = env.generate("train", 50, seed=3)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    # the problem identity (id = hash of its canonical key) never crosses splits
    ids = {s: {t.id for t in env.generate(s, 30, seed=3)} for s in ("train", "val", "test")}
    assert not ids["train"] & ids["test"] and not ids["val"] & ids["test"] and not ids["train"] & ids["val"]


@pytest.mark.parametrize("completion,expected", [
    ("<think>2+3=5.</think>5<|end|>", 1.0),
    ("<think>x</think>  5 ", 1.0),
    ("<think>x</think>+5", 1.0),
    ("<think>5</think>6", 0.0),
    ("the answer is 5", 0.0),
    ("<think>x</think>5 apples", 0.0),
    ("", 0.0),
])
def test_number_verifier_edge_formats(completion, expected):
    task = reasoning.generate("test", 1, 0)[0]
    task.answer = "5"
    assert reasoning.verify(task, completion)[0] == expected


def test_general_verifier_gives_partial_credit_with_reasons():
    task = next(t for t in general.generate("test", 50, 0) if t.meta["ending"] and t.meta["k"] > 1)
    assert general.verify(task, task.answer) == (1.0, "all constraints met")
    score, reason = general.verify(task, task.answer.lower().swapcase())
    assert score < 1.0 and "case" in reason


def test_tool_call_parsing_never_spans_tags():
    from environments.agentic import parse_tool_call
    assert parse_tool_call("<think>x</think><tool_call>read data.txt</tool_call><|end|>") == ("read", "data.txt")
    # a garbled sample is not a hack attempt: the complete call inside it is the one that counts
    assert parse_tool_call("<tool_call>read va.</think><tool_call>read values.txt</tool_call>") == ("read", "values.txt")
    assert parse_tool_call("<tool_call>read data.txt") is None


def test_agentic_steps_can_carry_the_numbers_left_from_the_world_config():
    """`world.domain_knobs.agentic.carry_rest`: each worked step writes the numbers still to add, so the next operand
    is the first of the list just written; the tasks, answers and tool outputs stay the world's."""
    from environments import agentic
    from posttrain.config import WorldConfig
    world = WorldConfig(max_operand=5, agentic_numbers=5, domain_knobs={"agentic": {"carry_rest": True}})
    plain = agentic.generate("train", 40, 0, **WorldConfig(max_operand=5, agentic_numbers=5).knobs("agentic"))
    carry = agentic.generate("train", 40, 0, **world.knobs("agentic"))
    assert [(t.prompt, t.answer, t.meta) for t in plain] == [(t.prompt, t.answer, t.meta) for t in carry]
    for p, c in zip(plain, carry):
        nums = [int(x) for x in c.meta["files"][next(iter(c.meta["files"]))].split()]
        steps = c.demo[-1]["reasoning_content"].split(". ")
        assert len(steps) == len(nums) - 1 and steps[-1].endswith(f"={c.answer}.")
        for i, step in enumerate(steps[:-1], 2):  # after the i-th number: the rest, in the file's order
            assert step.endswith(f" [{' '.join(map(str, nums[i:]))}]")
        assert "[" not in p.demo[-1]["reasoning_content"]  # the default: the running sums alone
    assert agentic.worked_steps([3, -1, 4]) == "3-1=2. 2+4=6."
    assert agentic.worked_steps([3, -1, 4], carry_rest=True) == "3-1=2 [4]. 2+4=6."
    with pytest.raises(ValueError, match="carry_rest"):
        agentic.generate("train", 2, 0, carry_rest="yes")
