"""Routing replay (posttrain.routing_replay): the rollout's experts travel with the sample and the trainer forces them."""
import pytest
import torch

from posttrain.models import moe
from posttrain.config import RLConfig
from posttrain.engines.torch_rollout import sample
from posttrain.engines.torch_train import TorchTrainEngine, policy_logits
from posttrain.rl.workers import Sample
from posttrain.routing_replay import prefix_calls
from tests.test_glm5_engines import sparse_glm

PROMPTS = [[5, 6, 7, 8, 9, 10, 11]] * 3 + [[20, 21, 22]] * 3


def rollout(model, seed=0, max_new_tokens=10):
    hooks = moe.RouterHooks(model)
    gens = sample(model, PROMPTS, max_new_tokens=max_new_tokens, temperature=1.0, stop_ids={2}, pad_id=0,
                  generator=torch.Generator().manual_seed(seed), routes=hooks)
    hooks.remove()
    return gens


def samples_of(gens, rewards=None):
    rewards = rewards or [float(i % 2) for i in range(len(gens))]
    return [Sample("t", i // 3, p, g.ids, [1] * len(g.ids), g.logprobs, rw, 0, routes=g.routes)
            for i, (p, g, rw) in enumerate(zip(PROMPTS, gens, rewards))]


def routes_of_full_forward(model, ids: list[int]) -> torch.Tensor:
    hooks = moe.RouterHooks(model)
    hooks.record()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    out = hooks.take_forward()
    hooks.remove()
    return out


def test_the_rollout_records_each_rows_experts_for_every_position_it_ran():
    model = sparse_glm()
    gens = rollout(model)
    assert len({tuple(g.ids) for g in gens}) > 2
    agree = total = 0
    for p, g in zip(PROMPTS, gens):
        # every position of prompt + ids went through the model but the last generated token
        assert g.routes.dtype == torch.int16 and tuple(g.routes.shape) == (3, len(p) + len(g.ids) - 1, 2)
        full = routes_of_full_forward(model, p + g.ids[:-1])
        same = (full.sort(-1).values == g.routes.long().sort(-1).values).all(-1)
        agree, total = agree + int(same.sum()), total + same.numel()
    assert agree / total > 0.98  # batched decoding vs one forward: equal up to a near-tie in float rounding


def test_replay_gives_the_rollouts_logprobs_after_the_routing_moved():
    model = sparse_glm()
    gens = rollout(model)
    samples = samples_of(gens)
    with torch.no_grad():  # the choice moves, the gate values of a given choice do not (bias: choice only)
        for _, r in moe.routers(model):
            r.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    behaviour = torch.nn.utils.rnn.pad_sequence([torch.tensor(g.logprobs) for g in gens], batch_first=True)
    real = behaviour != 0
    plain = TorchTrainEngine(model, policy_logits(0), lr=1e-3)
    lp_plain = plain.logprobs(samples, 1.0)[0].detach()
    replay = TorchTrainEngine(model, policy_logits(0), lr=1e-3, routing_replay=True)
    lp_replay, _ = replay.logprobs(samples, 1.0)
    torch.testing.assert_close(lp_replay.detach()[real], behaviour[real], rtol=0, atol=1e-4)
    assert (lp_plain[real] - behaviour[real]).abs().max() > 1e-2
    stats = replay.step_stats()  # what an RL step reports (the routes replayed since the last call)
    assert stats["routes_replayed"] > 0 and stats["routes_differ"] > 0.2  # the bias moved a good share
    lp_replay.sum().backward()  # the router still learns, through the replayed experts' gate weights
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_a_step_measures_what_replay_removes():
    """Each RL step under replay reports the rollout/trainer gap with and without it, on one micro-batch before the
    update (the figure behind `make figures`' replay claim): after the routing moved, replay leaves float noise, the
    trainer's own routing does not; the probe counts no expert load (it would move the balancing)."""
    from posttrain.rl.step import train_step
    model = sparse_glm()
    samples = samples_of(rollout(model))
    with torch.no_grad():
        for _, r in moe.routers(model):
            r.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    engine = TorchTrainEngine(model, policy_logits(0), lr=1e-3, routing_replay=True)
    engine.unreplayed_logprobs(samples, 1.0)
    assert all(float(x.sum()) == 0 for x in engine.routers.loads)
    stats = train_step(RLConfig(group_size=3, temperature=1.0), engine, samples)
    assert stats["replay_probe_with"] < 1e-4 and stats["replay_probe_without"] > 1e-3  # 0.005 here
    plain = train_step(RLConfig(group_size=3, temperature=1.0), TorchTrainEngine(sparse_glm(), policy_logits(0),
                                                                                  lr=1e-3), samples)
    assert "replay_probe_with" not in plain


@pytest.mark.parametrize("draft", [False, True])
def test_a_grpo_step_under_replay_trains_and_reports_what_replay_changed(draft):
    model = sparse_glm()
    if draft:  # an MTP draft layer: its router is balanced, but it runs outside the forward replay covers
        from posttrain.models import mtp
        mtp.install(model, 1)
        assert moe.RouterHooks(model).routed == len(moe.routers(model)) - 1 == 3
    samples = samples_of(rollout(model))
    assert samples[0].routes.shape[0] == 3
    engine = TorchTrainEngine(model, policy_logits(0), lr=1e-2, routing_replay=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from posttrain.rl.step import train_step
    stats = train_step(RLConfig(group_size=3, temperature=1.0), engine, samples)
    # same weights: replay changes nothing (routes recorded one token at a time may differ from the prefix forward's
    # only at a float near-tie between two experts)
    assert stats["logratio_abs"] < 1e-4 and stats["routes_differ"] < 0.02
    assert stats["masked_fraction"] == 0
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("experts" in k for k in moved) and any("mlp.gate.weight" in k for k in moved)


def test_routes_of_the_wrong_shape_or_none_at_all_are_refused():
    model = sparse_glm()
    samples = samples_of(rollout(model, max_new_tokens=4))
    with pytest.raises(ValueError, match="routes of shape .* for a policy with 4 routers"):
        prefix_calls(samples, 4)
    for s in samples:
        s.routes = None
    with pytest.raises(ValueError, match="no sample carries routes"):
        prefix_calls(samples, 3)


def test_replay_is_refused_for_a_dense_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    with pytest.raises(ValueError, match="routing_replay: LlamaForCausalLM has no mixture-of-experts router"):
        TorchTrainEngine(dense, policy_logits(0), lr=1e-3, routing_replay=True)


def test_the_config_refuses_replay_on_the_dense_preset():
    from posttrain.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="rl.routing_replay: needs a mixture-of-experts policy"):
        load_config("smoke-dense", ["rl.routing_replay=true"])
