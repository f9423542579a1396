"""MoE care for GLM-5-shaped models (posttrain/models/moe.py) on a tiny transformers GlmMoeDsaForCausalLM."""
import numpy as np
import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, LlamaConfig, LlamaForCausalLM

from posttrain.models import moe


def tiny_glm(seed: int = 0, **kw) -> GlmMoeDsaForCausalLM:
    """4 layers (the first dense), 8 routed experts top-2 plus a shared one, MLA, DSA with a shared-indexer layer."""
    cfg = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
               q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=64,
               index_head_dim=8, index_n_heads=2, indexer_types=["full", "full", "shared", "full"],
               max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**(cfg | kw))).float()
    with torch.no_grad():  # transformers initialises the router weight at zero: every expert ties
        for _, r in moe.routers(model):
            r.weight.normal_(0, 0.5)
    return model


def test_routers_are_found_on_the_moe_layers_only():
    names = [n for n, _ in moe.routers(tiny_glm())]
    assert names == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    hooks = moe.RouterHooks(dense)
    assert hooks.routers == [] and hooks.after_step(0.1) == {} and hooks.aux_loss() is None


def test_load_stats_match_numpy():
    load = torch.tensor([5.0, 0.0, 3.0, 8.0])
    s = moe.load_stats(load)
    a = load.numpy()
    assert s["cv"] == pytest.approx(a.std() / a.mean()) and s["max_mean"] == pytest.approx(a.max() / a.mean())
    assert s["dead"] == 1


def test_the_sign_rule_raises_underloaded_experts_and_lowers_overloaded_ones():
    model = tiny_glm()
    hooks = moe.RouterHooks(model)
    hooks.loads = [torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1]) for _ in hooks.routers]
    m = hooks.after_step(0.01)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias[0] == pytest.approx(-0.01) and torch.allclose(bias[1:], torch.full((7,), 0.01))
    assert m["moe_dead"] == 0 and m["moe_max_mean"] == pytest.approx(9 / 2)
    assert all(float(x.sum()) == 0 for x in hooks.loads)  # reset for the next step


def test_bias_updates_balance_a_skewed_router_without_any_optimizer():
    model = tiny_glm()
    with torch.no_grad():
        for _, r in moe.routers(model):
            r.weight[0] += 2.0 * model.model.embed_tokens.weight.mean(0)  # every token leans to expert 0
            r.weight[1] += 2.0 * model.model.embed_tokens.weight.mean(0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    hooks = moe.RouterHooks(model)
    x = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    cvs = []
    for _ in range(60):
        model(input_ids=x)  # grad enabled: loads are counted
        cvs.append(hooks.after_step(0.02)["moe_cv"])
    assert cvs[-1] < 0.5 * cvs[0]
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())  # only the buffer moved
    assert "e_score_correction_bias" not in dict(model.named_parameters())


def test_padding_is_not_counted_as_load():
    model = tiny_glm()
    hooks = moe.RouterHooks(model)
    x = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=x)
    alone = [t.clone() for t in hooks.loads]
    hooks.loads = [torch.zeros_like(t) for t in alone]
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    model(input_ids=padded, attention_mask=mask)
    assert all(a.sum() == 12 * 2 for a in alone)
    assert all(torch.equal(a, b) for a, b in zip(alone, hooks.loads))


def test_aux_loss_equals_deepseek_v3s_formula_and_trains_the_router():
    model = tiny_glm()
    hooks = moe.RouterHooks(model, aux=True)
    rec = []
    for _, r in hooks.routers:
        r.register_forward_hook(lambda mod, a, out: rec.append((out[0].detach(), out[2])))
    x = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    model(input_ids=x)
    aux = hooks.aux_loss()
    want = []
    for logits, idx in rec:
        s = logits.sigmoid().numpy()
        p = s / s.sum(-1, keepdims=True)
        for row in range(2):
            rows = slice(row * 10, row * 10 + 10)
            f = np.zeros(8)
            for e in idx[rows].reshape(-1).tolist():
                f[e] += 1
            f *= 8 / (2 * 10)
            want.append((f * p[rows].mean(0)).sum())
    assert float(aux.detach()) == pytest.approx(float(np.mean(want)), rel=1e-5)
    aux.backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_with_aux_loss_adds_a_gradient_but_keeps_the_loss_value():
    model = tiny_glm()
    hooks = moe.RouterHooks(model, aux=True)
    x = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))

    def lm(m, batch):
        return m(input_ids=batch, labels=batch).loss
    curve = []
    with_aux = moe.with_aux_loss(lm, hooks, 0.5, curve)
    torch.manual_seed(0)
    plain = lm(model, x)
    hooks.aux_loss()
    total = with_aux(model, x)
    assert float(total.detach()) == pytest.approx(float(plain.detach())) and len(curve) == 1 and curve[0] > 0
    total.backward()
    g_aux = model.model.layers[1].mlp.gate.weight.grad.clone()
    model.zero_grad()
    lm(model, x).backward()
    assert not torch.allclose(g_aux, model.model.layers[1].mlp.gate.weight.grad)
    assert moe.with_aux_loss(lm, hooks, 0.0) is lm


def test_replay_reproduces_the_recorded_routing_after_the_router_moved():
    model = tiny_glm().eval()
    hooks = moe.RouterHooks(model)
    x = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    hooks.record()
    with torch.no_grad():
        before = model(input_ids=x).logits
    routes = [calls[0] for calls in hooks.take_recorded()]
    assert [tuple(r.shape) for r in routes] == [(32, 2)] * 3
    with torch.no_grad():
        for _, r in hooks.routers:
            r.weight.add_(torch.randn_like(r.weight, generator=None) * 1.0)
        hooks.record()
        moved = model(input_ids=x).logits
        fresh = [calls[0] for calls in hooks.take_recorded()]
    changed = sum(bool((a.sort(-1).values != b.sort(-1).values).any()) for a, b in zip(routes, fresh))
    assert changed == 3 and not torch.allclose(moved, before, atol=1e-4)
    hooks.replay(routes)
    hooks.record()
    model.train()
    out = model(input_ids=x, labels=x)
    replayed = [calls[0] for calls in hooks.take_recorded()]
    assert all(torch.equal(a, b) for a, b in zip(routes, replayed))
    out.loss.backward()  # the router still learns through the replayed experts' gate weights
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    hooks.replay([torch.full_like(routes[0], -1), routes[1], routes[2]])  # -1 rows: the router chooses
    hooks.record()
    with torch.no_grad():
        model(input_ids=x)
    mixed = [calls[0] for calls in hooks.take_recorded()]
    assert torch.equal(mixed[0], fresh[0]) and torch.equal(mixed[1], routes[1])
    hooks.replay([routes[0][:5]] + routes[1:])
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate got \(5, 2\) routes for \(32, 2\)"):
        model(input_ids=x)


def test_replaying_its_own_routing_changes_nothing():
    model = tiny_glm().eval()
    hooks = moe.RouterHooks(model)
    x = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    hooks.record()
    with torch.no_grad():
        own = model(input_ids=x).logits
    hooks.replay([c[0] for c in hooks.take_recorded()])
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, own)


def test_the_bias_survives_save_and_load(tmp_path):
    model = tiny_glm()
    hooks = moe.RouterHooks(model)
    hooks.loads = [torch.arange(8.0) for _ in hooks.routers]
    hooks.after_step(0.05)
    model.save_pretrained(tmp_path)
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    for (_, a), (_, b) in zip(moe.routers(model), moe.routers(back)):
        assert b.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)


def test_unfused_experts_compute_what_the_fused_ones_do(tmp_path):
    model = tiny_glm().eval()
    x = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        fused = model(input_ids=x).logits
    assert moe.unfuse_experts(model) == 3
    assert type(model.model.layers[1].mlp.experts).__name__ == "LinearExperts"
    assert model.model.layers[1].mlp.experts[7].down_proj.weight.shape == (32, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, fused, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path)  # per-expert Linears save as checkpoints store experts, and load fused
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, fused, rtol=0, atol=1e-5)


def test_balancing_under_data_parallel_reduces_the_loads(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = tiny_glm()
        hooks = moe.RouterHooks(model)
        hooks.loads = [torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1]) for _ in hooks.routers]
        assert hooks.after_step(0.01)["moe_max_mean"] == pytest.approx(9 / 2)
        assert hooks.after_step(0.01) == {}  # a step without tokens still takes part in the reduction
    finally:
        dist.destroy_process_group()
