"""DSA's adoption on GLM-5's own indexers (posttrain.models.glm5.install_dsa): the sparse attention is transformers'
own at the same top-k and reloads so, the dense warm-up trains only those indexers towards the dense attention, and
a ramp rung adopts it."""
import pytest
import torch

from posttrain.stages import ramp
from posttrain.config import ConfigError, ModelConfig, load_config
from posttrain.models import dsa, glm5
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
from posttrain.packing import collate, pack
from tests.test_dsa import warm_up
from tests.test_glm5_model import GLM5

IDS = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def model(tok):
    torch.manual_seed(0)
    m = build_model(ModelConfig(**GLM5), tok)
    with torch.no_grad():  # peaked attention, as a trained model's: the indexers have something to learn
        for layer in m.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(30)
            layer.self_attn.kv_b_proj.weight.mul_(30)
    return m.eval()


def _logits(m):
    with torch.no_grad():
        return m(IDS, use_cache=False).logits


def test_the_adopted_attention_is_transformers_own_at_the_same_top_k_and_reloads_so(model, tok, tmp_path):
    dense = _logits(model)
    for layer in model.model.layers:  # transformers' DSA (sdpa path) at top-8 of up to 40 keys
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 8
    theirs = _logits(model)
    assert not torch.allclose(theirs, dense, atol=1e-2)
    glm5.install_dsa(model, top_k=8)
    assert model.config._attn_implementation == "glm5_dsa" and dsa.state(model).top_k == 8
    torch.testing.assert_close(_logits(model), theirs, atol=1e-5, rtol=1e-5)
    save_checkpoint(model, tok, tmp_path / "ckpt")
    again, _ = load_checkpoint(tmp_path / "ckpt")
    assert again.config.index_topk == 8 and glm5.dsa_adopted(again)
    torch.testing.assert_close(_logits(again.eval()), theirs, atol=1e-5, rtol=1e-5)


def test_the_warmup_trains_only_glm5s_own_indexers_towards_the_dense_attention(model):
    cfg = load_config("smoke-dense", ["ramp.attention=dsa", "ramp.dsa={top_k: 8, warmup_steps: 30, warmup_lr: 0.05}"])
    glm5.install_dsa(model, top_k=8)
    rows = pack([(IDS[i % 2, :30 + i].tolist(), [1] * (30 + i)) for i in range(8)], 64)
    curves, (kl0, recall0), (kl1, recall1) = warm_up(cfg, model, rows)
    assert len(curves["indexer_kl"]) == 30 and kl0 > 0.1
    assert kl1 < 0.95 * kl0 and recall1 > recall0, (kl0, kl1, recall0, recall1)


@pytest.mark.parametrize("engine", ["torch", "megatron"])
def test_a_ramp_rung_adopts_dsa_on_glm5s_indexers(model, tok, engine, request):
    """Through either train engine: the megatron one runs the warm-up and the sparse rung in Megatron's layers, its
    indexers inside the core attention (`engines.megatron_dsa`)."""
    if engine == "megatron":
        request.getfixturevalue("megatron_groups")
    sets = [f"model.{k}={v}" for k, v in GLM5.items() if not isinstance(v, list)] + [
        "model.indexer_types=[full, full, shared, full]", "quantize.group_size=16", "ramp.attention=dsa", "ramp.batch_size=2",
        "ramp.dsa={top_k: 8, warmup_steps: 3, kl_queries: 16}", f"runtime.train_engine={engine}",
        "ramp.stages=[{seq_len: 64, tokens: 512, lr: 1.0e-3, warmup: 1, rope_theta: 20000.0, long_share: 0.5}]"]
    cfg = load_config("smoke-dense", sets)
    docs = [IDS[i % 2, :20 + i].tolist() for i in range(12)]
    short_val = collate(pack([(d, [1] * len(d)) for d in docs[:4]], 64), 0)
    model, child = ramp.train_stage(cfg, 0, cfg.ramp.stages[0], model, tok, docs, {}, short_val)
    assert glm5.dsa_adopted(model) and model.config.index_topk == 8
    m = child["metrics"]
    assert m["steps"] == 4 and "dsa_warmup.indexer_kl_last" in m and "indexer_kl_last" in m
    assert 0 < m["topk_recall_last"] <= 1


def test_dsa_settings_glm5_lays_out_itself_are_refused():
    cfg = load_config("tiny", ["ramp.attention=dsa", "ramp.dsa.top_k=64"])
    type(cfg).model_validate(cfg.model_dump(mode="json"))  # a run's saved config (every field set) reloads
    megatron = ["ramp.attention=dsa", "ramp.dsa.top_k=64", "runtime.train_engine=megatron"]
    load_config("tiny", megatron)
    with pytest.raises(ConfigError, match=r"ramp.attention: dsa on a dense model adds posttrain's own indexers"):
        load_config("tiny-dense", megatron)
    with pytest.raises(ConfigError, match=r"ramp.dsa.own_indexer: GLM-5's own indexers are laid out by "
                                          r"model.indexer_types"):
        load_config("tiny", ["ramp.attention=dsa", "ramp.dsa={top_k: 64, own_indexer: [0, 1]}"])


@pytest.mark.parametrize("keys", [100, 300])  # both sides of the rule: training pads above 256 keys only
def test_mlas_attention_padded_for_the_flash_kernel_is_the_librarys_attention(keys):
    """`glm5.mla_sdpa` (transformers' "sdpa" on CPU for MLA's narrower values) gives the library's attention and its
    gradients, masked, in float64 (where the two kernels' sums may differ only at ~1e-15)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, keys, 48, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, keys, 32, dtype=torch.float64, generator=g, requires_grad=True)
    mask = (torch.rand(2, 1, keys, keys, generator=g) > 0.5) | torch.eye(keys, dtype=torch.bool)
    module = SimpleNamespace(is_causal=False, num_key_value_groups=1)
    outs = []
    for attend in (glm5.mla_sdpa, sdpa_attention_forward):
        out, _ = attend(module, q, k, v, mask)
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
        outs.append((out, *grads))
    for ours, theirs in zip(*outs):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(glm5.mla_sdpa(module, q, k, v, mask)[0], outs[1][0], atol=1e-12, rtol=0)
