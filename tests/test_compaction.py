"""Context compaction in agentic episodes: sub-traces that are token in, token out, trainable by critic PPO,
refused by GRPO; truncation where compaction is off."""
import pytest
import torch

from environments import agentic
from environments.episode import Episode
from posttrain.chat import render_ids
from posttrain.config import RLConfig
from posttrain.engines.base import Generation
from posttrain.rl.rollout import run_episodes
from posttrain.rl.workers import samples_of


def _tasks(split: str = "test", n: int = 4):
    return agentic.generate(split, n, 0, agentic_files=3, agentic_numbers=2, max_operand=5)


def _forms(t):
    """A task's demonstrations: whole, resumed after k reads, and asked for its notes after k reads."""
    return [t, *(agentic.resumed(t, k) for k in (1, 2, 3)),
            *(agentic.summarized(t, k, j) for k in (1, 2, 3) for j in range(k))]


def _render(tok, task):
    """A demonstration as an episode's context has it: earlier turns' thinking kept."""
    return render_ids(tok, task.messages(with_demo=True), preserve_thinking=True)


class Oracle:
    """A rollout engine that acts as the demonstrations do: the context must be a prefix of the rendering of a
    task's demonstration, from the start or resumed after k reads (what a compaction leaves), and the next
    action is that rendering's next assistant turn."""

    def __init__(self, tok, tasks):
        self.tokenizer, self.version, self.end = tok, 0, tok.convert_tokens_to_ids("<|end|>")
        self.renders = [_render(tok, v) for t in tasks for v in _forms(t)]

    def generate(self, prompts, *, max_new_tokens, temperature, stop_ids, generator=None):
        out = []
        for p in prompts:
            full = next(r for r in self.renders if r[:len(p)] == p)
            turn = full[len(p): full.index(self.end, len(p)) + 1]
            assert len(turn) <= max_new_tokens
            out.append(Generation(turn, [-0.5] * len(turn), "stop"))
        return out


def _budget(tok, tasks) -> tuple[int, int]:
    """A turn's generation budget (the longest turn of the demonstrations) and a context budget that no whole
    episode fits in."""
    end = tok.convert_tokens_to_ids("<|end|>")
    renders = [render_ids(tok, t.messages(with_demo=True)) for t in tasks]
    ends = [[i for i, x in enumerate(r) if x == end] for r in renders]
    return min(map(len, renders)) - 2, max(e[-1] - e[-2] for e in ends)  # the final answer is the longest turn


def test_compacted_episode_is_token_in_token_out_on_every_subtrace(tok):
    tasks = _tasks()
    budget, new = _budget(tok, tasks)
    eps = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget)
    for t, e in zip(tasks, eps):
        traces = e.traces()
        assert e.reward == 1.0 and not e.truncated and len(traces) >= 2
        for tr in traces:  # each sub-trace fits, and is exactly the template's rendering of some conversation
            assert len(tr.prompt_ids) + len(tr.ids) <= budget
            seq = tr.prompt_ids + tr.ids
            assert any(r[:len(seq)] == seq for r in [_render(tok, v) for v in _forms(t)])
        # the note after a compaction is what the training data's resumed form says
        resumed_prompts = [render_ids(tok, agentic.resumed(t, k).messages(), add_generation_prompt=True)
                           for k in (1, 2, 3)]
        assert all(tr.prompt_ids in resumed_prompts for tr in traces[1:])
        assert e.n_generated == sum(sum(tr.gen_mask) for tr in traces)


def test_the_policy_writes_the_notes_a_compaction_carries_over(tok):
    """rl.compaction_summary: policy. At a compaction the episode asks for notes after the tool response; the
    policy's answer closes the sub-trace as generated tokens (trained with it) and is the next sub-trace's note.
    Token in, token out: each closed sub-trace is exactly the template's rendering of the summary demonstration."""
    tasks = _tasks()
    budget, new = _budget(tok, tasks)
    new += 16  # notes on three reads are longer than any turn of the demonstrations
    small = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget,
                         summary="policy")
    assert all(e.truncated and e.reward == 0.0 and "the summary request does not fit" in e.reason for e in small)
    budget += new  # room for the request and the notes
    rules = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget)
    eps = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget,
                       summary="policy")
    end = tok.convert_tokens_to_ids("<|end|>")
    for t, e, r in zip(tasks, eps, rules):
        traces = e.traces()
        assert e.reward == 1.0 and not e.truncated and len(e.summaries) == len(traces) - 1 >= 2  # notes on notes
        assert len(traces) >= len(r.traces())  # it compacts no later: the request and the notes need room
        for tr, note in zip(traces, e.summaries):
            seq = tr.prompt_ids + tr.ids
            assert len(seq) <= budget and seq[-1] == end
            assert seq in [_render(tok, agentic.summarized(t, k, j)) for k in (1, 2, 3) for j in range(k)]
            reply = tok.encode(note, add_special_tokens=False)
            assert tr.ids[-len(reply) - 1:-1] == reply and all(tr.gen_mask[-len(reply) - 1:])  # generated, trained
        resumed_prompts = [render_ids(tok, agentic.resumed(t, k).messages(), add_generation_prompt=True)
                           for k in (1, 2, 3)]
        assert all(tr.prompt_ids in resumed_prompts for tr in traces[1:])
    with pytest.raises(ValueError, match="summary must be"):
        run_episodes(Oracle(tok, tasks), tok, tasks, context_budget=budget, summary="model")


def test_without_compaction_the_same_budget_truncates_with_no_reward(tok):
    tasks = _tasks()
    budget, new = _budget(tok, tasks)
    eps = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget,
                       compaction=False)
    assert all(e.truncated and e.reward == 0.0 and "context budget" in e.reason for e in eps)
    assert all(len(e.traces()) == 1 for e in eps)
    whole = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new)  # no budget: all pass
    assert all(e.reward == 1.0 and len(e.traces()) == 1 for e in whole)


def test_every_subtrace_is_a_sample_with_the_episode_reward(tok):
    tasks = _tasks()
    budget, new = _budget(tok, tasks)
    eps = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget)
    eps[0].reward = 0.0
    samples = samples_of(eps, 1, len(eps), version=3)
    assert len(samples) == sum(len(e.traces()) for e in eps) > len(eps)
    for s in samples:
        assert s.reward == eps[s.group].reward and s.version == 3
    assert [s.subtrace for s in samples if s.group == 1] == list(range(len(eps[1].traces())))


def test_ppo_trains_on_compacted_subtraces(tok):
    """Critic PPO on the sub-traces of compacted episodes: every sub-trace of a rewarded episode gains
    log-probability against those of unrewarded ones, and the critic trains."""
    import copy
    from posttrain.config import ModelConfig
    from posttrain.engines.torch_train import TorchTrainEngine, policy_logits
    from posttrain.models.preset import build_model
    from posttrain.models.value import ValueModel
    from posttrain.rl.step import train_step
    from posttrain.engines.optim import make_optimizer
    import tempfile
    from posttrain.models.preset import save_checkpoint
    tasks = _tasks("test", 8)
    budget, new = _budget(tok, tasks)
    eps = run_episodes(Oracle(tok, tasks), tok, tasks, max_turns=6, max_new_tokens=new, context_budget=budget)
    for i, e in enumerate(eps):
        e.reward = float(i % 2)
    samples = samples_of(eps, 1, len(eps), version=0)
    assert len(samples) > len(eps)
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                    max_position_embeddings=256), tok)
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(model, tok, d)
        critic = ValueModel(d)
    policy = copy.deepcopy(model).train()
    r = RLConfig(algorithm="ppo", group_size=1, lr=1e-3, context_budget=budget)
    pe = TorchTrainEngine(policy, policy_logits(tok.pad_token_id), optimizer=make_optimizer(policy, r.lr))
    ce = TorchTrainEngine(critic, lambda m, ss: m(ss, tok.pad_token_id), optimizer=make_optimizer(critic, 3e-3))

    def mean_logp(rewarded: bool) -> float:
        with torch.no_grad():
            sub = [s for s in samples if (s.reward == 1.0) == rewarded]
            logp, _ = pe.logprobs(sub, 1.0)
            mask = completion_mask(sub)
            return ((logp * mask).sum() / mask.sum()).item()

    with torch.no_grad():  # the oracle's behaviour logprobs made on-policy, so importance sampling keeps them
        logp, _ = pe.logprobs(samples, 1.0)
    for i, smp in enumerate(samples):
        smp.logprobs = [x * m for x, m in zip(logp[i, :len(smp.ids)].tolist(), smp.gen_mask)]
    gap0 = mean_logp(True) - mean_logp(False)
    stats = [train_step(r, pe, samples, ce) for _ in range(4)]
    assert mean_logp(True) - mean_logp(False) > gap0
    assert all(s["grad_norm"] > 0 and s["critic_grad_norm"] > 0 for s in stats)
    assert stats[-1]["value_loss"] < stats[0]["value_loss"]


def completion_mask(samples) -> torch.Tensor:
    from posttrain.rl.batches import completion_batch
    return completion_batch(samples)["mask"]


def test_the_loop_records_how_episodes_were_split(tok, tmp_path):
    from posttrain.config import ModelConfig
    from posttrain.models.preset import build_model, save_checkpoint
    from posttrain.rl.loop import train_policy
    torch.manual_seed(0)
    save_checkpoint(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                            max_position_embeddings=256), tok), tok, tmp_path)
    tasks = _tasks("test", 8)
    r = RLConfig(algorithm="ppo", group_size=1, steps=2, prompts_per_step=4, max_new_tokens=8, max_turns=6,
                 val_every=0, context_budget=48, max_staleness=0, stop_check=False)  # untrained weights never stop
    _, _, st = train_policy(r, str(tmp_path), tasks, tasks[:2], seed=0)
    h = st.history
    for key in ("subtraces_per_episode", "subtrace_tokens", "subtrace_tokens_max", "truncated_share"):
        assert len(h[key]) == 2, key
    assert all(x >= 1 for x in h["subtraces_per_episode"]) and all(m <= 48 for m in h["subtrace_tokens_max"])


def test_grpo_refuses_compaction_and_sequence_means_are_refused():
    with pytest.raises(ValueError, match="GRPO compares whole episodes"):
        RLConfig(algorithm="grpo", context_budget=64)
    with pytest.raises(ValueError, match="loss_agg: token"):
        RLConfig(algorithm="ppo", group_size=1, context_budget=64, loss_agg="sequence")
    RLConfig(algorithm="grpo", context_budget=64, compaction=False)  # truncation alone is fine for GRPO
    with pytest.raises(ValueError, match="rl.per_domain.agentic"):
        RLConfig(per_domain={"agentic": {"context_budget": 64}})


def test_training_split_holds_resumed_forms_and_evaluation_splits_do_not():
    train = agentic.generate("train", 40, 0, agentic_files=3, agentic_numbers=2, max_operand=5)
    resumed = [t for t in train if t.meta.get("resumed_from")]
    assert 0 < len(resumed) < len(train) and all("Notes: " in t.prompt for t in resumed)
    assert not any(t.meta.get("resumed_from") for t in _tasks("test", 20))
    with_notes = agentic.generate("train", 40, 0, agentic_files=3, agentic_numbers=2, max_operand=5,
                                  agentic_summary_share=0.5)
    summarized = [t for t in with_notes if t.meta.get("summarized_from")]
    assert 0 < len(summarized) and all(t.demo[-1]["content"].startswith("Notes: ") for t in summarized)
    assert [t for t in with_notes if t.meta.get("resumed_from")] == resumed  # the other forms stay as they were
    one_file = agentic.generate("train", 20, 0)
    assert not any(t.meta.get("resumed_from") for t in one_file)


def test_an_episode_whose_note_does_not_fit_ends_truncated(tok):
    task = _tasks()[0]
    e = Episode(task, tok, max_turns=6, context_budget=len(render_ids(tok, task.messages(),
                                                                       add_generation_prompt=True)) + 12,
                max_new_tokens=12)
    e.reset()
    full = render_ids(tok, task.messages(with_demo=True))
    end = tok.convert_tokens_to_ids("<|end|>")
    first = full[len(e.prompt_ids): full.index(end, len(e.prompt_ids)) + 1]
    step = e.step(first)
    assert step.done and e.truncated and e.reward == 0.0
    assert len(e.traces()) == 1 and e.traces()[0].ids == first  # the closed sub-trace, without the observation
