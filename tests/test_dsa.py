"""DSA on the model: sparse attention that is dense when every key fits, IndexShare, checkpoints that reload with
their indexers, decoding with a KV cache, and the ramp's adoption (the indexer warm-up learns the dense attention,
nothing else moves)."""
import json

import pytest
import torch

from posttrain.stages import ramp
from posttrain.models import dsa
from posttrain.config import ConfigError, ModelConfig, load_config
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
from posttrain.packing import collate, pack


@pytest.fixture
def model(tok):
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                max_position_embeddings=256), tok)
    with torch.no_grad():  # peaked attention, as a trained model's: the indexer has something to learn
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    return m.eval()


IDS = torch.randint(3, 300, (2, 80), generator=torch.Generator().manual_seed(0))


def logits(m, **kw):
    with torch.no_grad():
        return m(IDS, use_cache=False, **kw).logits


def test_every_key_selected_is_dense_attention_and_fewer_is_not(model):
    dense = logits(model)
    dsa.install(model, top_k=80)
    assert model.config._attn_implementation == "dsa"
    torch.testing.assert_close(logits(model), dense)
    dsa.state(model).top_k = 8
    assert not torch.allclose(logits(model), dense, atol=1e-3)


def test_index_share_runs_one_indexer_per_group_of_layers(model):
    dsa.install(model, top_k=8, index_share=2)
    with_indexer = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.self_attn, "indexer")]
    assert with_indexer == [0, 2]
    calls = []
    for i in with_indexer:
        model.model.layers[i].self_attn.indexer.register_forward_hook(lambda *a: calls.append(1))
    logits(model)
    assert len(calls) == 2 and set(dsa.state(model).selection) == {0, 2}


def test_index_share_groups_keep_transition_layers_alone():
    assert dsa.groups(8, 4) == [0, 0, 0, 0, 4, 4, 4, 4]
    assert dsa.groups(8, 4, own=[0]) == [0, 1, 1, 1, 1, 5, 5, 5]
    assert dsa.groups(6, 2, own=[2]) == [0, 0, 2, 3, 3, 5]
    assert dsa.groups(3, 1) == [0, 1, 2]


def test_an_own_indexer_layer_keeps_its_indexer_and_the_rest_share(model):
    dsa.install(model, top_k=8, index_share=4, own=[0])
    assert [i for i, layer in enumerate(model.model.layers) if hasattr(layer.self_attn, "indexer")] == [0, 1]
    logits(model)
    assert set(dsa.state(model).selection) == {0, 1}


def test_an_own_indexer_layer_outside_the_model_is_refused(model):
    with pytest.raises(ValueError, match=r"own indexer layers \[4\] must be layer indices of this 4-layer model"):
        dsa.install(model, top_k=8, index_share=2, own=[4])


def test_checkpoint_reloads_with_its_indexers(model, tok, tmp_path):
    dsa.install(model, top_k=8, index_share=2, heads=2)
    before = logits(model)
    save_checkpoint(model, tok, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[dsa.CONFIG_KEY] == \
        {"top_k": 8, "index_share": 2, "heads": 2, "kl_queries": 64, "own": []}
    again, _ = load_checkpoint(tmp_path)
    assert again.config._attn_implementation == "dsa"
    torch.testing.assert_close(logits(again.eval()), before)
    from posttrain.models.value import ValueModel  # the critic's backbone too
    assert dsa.state(ValueModel(str(tmp_path)).backbone).top_k == 8


def test_greedy_decoding_with_a_kv_cache_selects_what_a_full_forward_does(model):
    dsa.install(model, top_k=8)
    prompt = IDS[:, :30]
    out = [model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                          use_cache=cache) for cache in (True, False)]
    assert torch.equal(out[0], out[1])


def test_packed_documents_stay_apart_under_dsa(model):
    """A document's outputs do not change when another document shares its row: selection stays in-document."""
    dsa.install(model, top_k=8)
    a, b = IDS[0, :30].tolist(), IDS[1, :25].tolist()
    batch = collate([[(b, [1] * 25), (a, [1] * 30)]], 0)
    with torch.no_grad():
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0, 25:]
        alone = model(torch.tensor([a]), use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def warm_up(cfg, model, rows: list) -> tuple[dict, tuple[float, float], tuple[float, float]]:
    """The ramp's indexer warm-up on `rows` (its curves), with the indexers' (KL, recall) on a held-out batch before
    and after; checks that the indexers moved and nothing else did (tests/test_glm5_dsa.py too)."""
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." not in n}
    indexers = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." in n}
    held_out = collate(rows[:2], 0)

    def measure() -> tuple[float, float]:
        st = dsa.state(model)
        st.collect = True
        model.model(held_out["input_ids"], position_ids=held_out["position_ids"], use_cache=False)
        st.collect = False
        _, kl, recall = st.pop()
        return kl, recall

    before = measure()
    curves, _ = ramp.indexer_warmup(cfg, model.train(), None, lambda i: collate(rows[i % len(rows):][:2], 0),
                                    cfg.ramp.stages[-1], "test")
    after = measure()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(not torch.equal(p, indexers[n]) for n, p in model.named_parameters() if n in indexers)
    assert all(p.requires_grad for p in model.parameters()) and dsa.state(model).mode == "sparse"
    return curves, before, after


def test_warmup_trains_only_the_indexers_towards_the_dense_attention(model, tok):
    cfg = load_config("smoke-dense", ["ramp.attention=dsa", "ramp.dsa={top_k: 16, warmup_steps: 20, warmup_lr: 0.02}"])
    dsa.install(model, top_k=16)
    rows = pack([(IDS[i % 2, :40 + i].tolist(), [1] * (40 + i)) for i in range(8)], 128)
    curves, (kl0, recall0), (kl1, recall1) = warm_up(cfg, model, rows)
    assert len(curves["indexer_kl"]) == 20
    assert kl1 < 0.5 * kl0 and recall1 > recall0, (kl0, kl1, recall0, recall1)


def test_dsa_settings_that_would_do_nothing_are_refused():
    with pytest.raises(ConfigError, match="ramp.dsa.top_k: 128 is not below the longest stage's seq_len 128"):
        load_config("smoke-dense", ["ramp.attention=dsa", "ramp.dsa.top_k=128"])
    with pytest.raises(ConfigError, match="ramp.dsa.adopt_at: 100 is not a stage's seq_len"):
        load_config("smoke-dense", ["ramp.attention=dsa", "ramp.dsa={top_k: 16, adopt_at: 100}"])
    assert load_config("smoke-dense", ["ramp.attention=dsa", "ramp.dsa.top_k=100"]).ramp.dsa_start() == 128
    with pytest.raises(ConfigError,
                       match=r"ramp.dsa.own_indexer: layers must be < model.num_layers 1 \(got \[0, 2\]\)"):
        load_config("smoke-dense", ["ramp.attention=dsa", "ramp.dsa={top_k: 16, own_indexer: [0, 2]}"])


def test_the_w4a8_export_keeps_dsa(model, tok, tmp_path):
    from posttrain.config import QuantizeConfig
    from posttrain.quant.int_linear import load_compressed
    from posttrain.stages.quantize import calibrate, export
    dsa.install(model, top_k=8)
    qcfg = QuantizeConfig(group_size=64)
    export(model, tok, calibrate(model, IDS[:, :32], qcfg), qcfg, tmp_path)
    again, _ = load_compressed(tmp_path)
    assert again.config._attn_implementation == "dsa" and dsa.state(again).top_k == 8
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in again.named_parameters() if ".indexer." in n)
