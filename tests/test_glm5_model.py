"""The glm5 preset (GLM-5's architecture at toy size, transformers' GlmMoeDsaForCausalLM): config rules, build,
checkpoints."""
import json

import pytest
import torch
from safetensors import safe_open

from posttrain.models import moe
from posttrain.config import ConfigError, ModelConfig, load_config
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint

GLM5 = dict(arch="glm5", hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, index_heads=2, index_head_dim=8,
            indexer_types=["full", "full", "shared", "full"], max_position_embeddings=64)


@pytest.mark.parametrize("change, key", [
    ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types: layer 0"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types: must name one type per layer"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"n_group": 8}, "n_group"),
    ({"n_group": 3}, "n_group"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
    ({"num_kv_heads": 1}, "num_kv_heads"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
])
def test_glm5_shapes_that_cannot_build_are_refused_with_their_key(change, key):
    with pytest.raises(ValueError, match=f"model.{key}"):
        ModelConfig(**(GLM5 | change))


def test_the_tiny_default_is_glm5():
    cfg = load_config("tiny", [])
    assert cfg.model.arch == "glm5" and cfg.model.layer_indexers() == ["full", "full", "shared", "full"]


def test_quantize_groups_must_divide_the_experts_width():
    sets = [f"model.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in (GLM5 | {"moe_intermediate_size": 24}).items()]
    with pytest.raises(ConfigError, match="quantize.group_size: must divide model.moe_intermediate_size"):
        load_config("smoke-dense", sets + ["quantize.group_size=16"])


def test_the_preset_builds_glm5s_layout(tok):
    model = build_model(ModelConfig(**GLM5), tok)
    c = model.config
    assert type(model).__name__ == "GlmMoeDsaForCausalLM" and not c.tie_word_embeddings
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "gate") and all(hasattr(layer.mlp, "gate") for layer in layers[1:])
    assert [layer.self_attn.indexer is None for layer in layers] == [False, False, True, False]
    assert c.head_dim == 8 and c.n_routed_experts == 8 and c.num_experts_per_tok == 2
    assert layers[1].mlp.experts.gate_up_proj.shape == (8, 32, 32)
    assert all(r.weight.std() > 0 for _, r in moe.routers(model))  # not transformers' all-zero ties
    assert len(tok) == c.vocab_size


def test_a_glm5_checkpoint_round_trips_exactly_and_keeps_the_router_bias_in_fp32(tok, tmp_path):
    model = build_model(ModelConfig(**GLM5), tok)
    with torch.no_grad():
        for i, (_, r) in enumerate(moe.routers(model)):
            r.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8) + 1e-4 * i)
    save_checkpoint(model, tok, tmp_path / "fp32")
    back, _ = load_checkpoint(tmp_path / "fp32")
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    setattr(back.config, "posttrain_dtype", "bfloat16")  # a bf16 chain: every tensor bf16 but the bias
    save_checkpoint(back, tok, tmp_path / "bf16")
    with safe_open(str(next((tmp_path / "bf16").glob("*.safetensors"))), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    bias = [k for k in dtypes if k.endswith("e_score_correction_bias")]
    assert len(bias) == 3 and all(dtypes[k] == torch.float32 for k in bias)
    assert {d for k, d in dtypes.items() if k not in bias} == {torch.bfloat16}
    again, _ = load_checkpoint(tmp_path / "bf16")
    for (_, a), (_, b) in zip(moe.routers(model), moe.routers(again)):
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)


def test_the_preset_learns_and_balances_its_experts(tok):
    from posttrain.config import MoEConfig
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.train import train
    torch.manual_seed(0)
    model = build_model(ModelConfig(**GLM5), tok)
    ids = tok("12 + 7 = 19. 3 + 4 = 7. 5 + 5 = 10.", add_special_tokens=False)["input_ids"]
    batch = {"input_ids": torch.tensor([ids] * 4), "attention_mask": torch.ones(4, len(ids), dtype=torch.long),
             "loss_mask": torch.ones(4, len(ids))}
    engine = TorchTrainEngine.for_lm(model, lr=1e-2, moe=MoEConfig(bias_update_rate=1e-3, aux_loss_weight=1e-4))
    hist = train(engine, lambda i: batch, steps=40, lr=1e-2, warmup=2, desc="glm5")
    assert hist["loss"][-1] < 0.5 * hist["loss"][0]
    assert len(hist["moe_cv"]) == 40 and len(hist["moe_aux_loss"]) == 40 and hist["moe_max_mean"][0] >= 1
    assert all(r.e_score_correction_bias.abs().sum() > 0 for _, r in moe.routers(model))  # balancing moved them
    before = [r.e_score_correction_bias.clone() for _, r in moe.routers(model)]
    hist = train(TorchTrainEngine.for_lm(model, lr=1e-3), lambda i: batch, steps=2, lr=1e-3, warmup=1,
                 desc="glm5")  # moe None: left alone
    assert "moe_cv" not in hist
    assert all(torch.equal(b, r.e_score_correction_bias) for b, (_, r) in zip(before, moe.routers(model)))


def test_a_glm5_checkpoint_whose_indexer_pattern_misses_layers_fails_naming_key_and_file(tok, tmp_path):
    from posttrain.models.preset import CheckpointError, check_folder
    save_checkpoint(build_model(ModelConfig(**GLM5), tok), tok, tmp_path)
    check_folder(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"indexer_types": ["full", "shared"]}))
    with pytest.raises(CheckpointError, match=r"config\.json: indexer_types has 2 entries for num_hidden_layers 4"):
        check_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"indexer_types": ["shared", "full", "full", "full"]}))
    with pytest.raises(CheckpointError, match=r"indexer_types\[0\] is 'shared'"):
        check_folder(tmp_path)


def test_glm5s_mtp_layer_is_its_own_draft_layer_stored_where_glm5_keeps_it(tok, tmp_path):
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    from posttrain.engines.speculative import sample_speculative
    from posttrain.engines.torch_rollout import sample
    from posttrain.models import mtp
    torch.manual_seed(0)
    model = mtp.install(build_model(ModelConfig(**GLM5), tok), 2).eval()
    draft = model.mtp
    assert hasattr(draft.layer.mlp, "gate") and draft.layer.self_attn.indexer is not None  # routed experts, DSA
    assert "mtp.layer.mlp.gate" in dict(moe.routers(model))                                  # balanced like the rest
    with torch.no_grad():
        draft.proj.weight.normal_(std=0.3)   # a draft that disagrees with the model: every rejection path runs
        draft.norm_e.weight.uniform_(0.5, 1.5)
    save_checkpoint(model, tok, tmp_path / "ckpt")
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert not any(k.startswith("mtp.") for k in saved)
    n = f"model.layers.{GLM5['num_layers']}."
    assert {n + k for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                            "mlp.experts.7.up_proj.weight", "self_attn.indexer.wk.weight")} <= set(saved)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # a serving engine's draft from the saved tensors (eh_proj over [enorm(embedding), hnorm(state)]) = ours
    ids = torch.randint(3, len(tok), (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        state = model.model(input_ids=ids).last_hidden_state
        nxt = torch.roll(ids, -1, 1)
        eps = model.config.rms_norm_eps
        x = F.linear(torch.cat([F.rms_norm(model.model.embed_tokens(nxt), (32,), saved[n + "enorm.weight"], eps),
                                F.rms_norm(state, (32,), saved[n + "hnorm.weight"], eps)], -1), saved[n + "eh_proj.weight"])
        mask = torch.full((12, 12), float("-inf")).triu(1)[None, None].expand(2, 1, 12, 12)
        out = draft.layer(x, attention_mask=mask, position_ids=pos,
                          position_embeddings=model.model.rotary_emb(x, pos))[0]
        want = model.lm_head(F.rms_norm(out, (32,), saved[n + "shared_head.norm.weight"], eps))
        got = draft.logits(model, draft.step(model, state, nxt, pos, mask))
    assert (got - want).abs().max() < 1e-5
    back, _ = load_checkpoint(tmp_path / "ckpt")
    assert mtp.get(back).depth == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.state_dict().items())
    # a GLM-5 checkpoint that names only num_nextn_predict_layers (no posttrain settings): its draft layer, depth 1
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del cfg["posttrain_mtp"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    bare, _ = load_checkpoint(tmp_path / "ckpt")
    assert mtp.get(bare).depth == 1 and torch.equal(bare.mtp.proj.weight, draft.proj.weight)
    # speculative decoding through it keeps greedy decoding's output
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100] * 9]
    plain = sample(back, prompts, max_new_tokens=16, temperature=0, stop_ids=set(), pad_id=0)
    stats = {}
    spec = sample_speculative(back, prompts, max_new_tokens=16, temperature=0, stop_ids=set(), pad_id=0, stats=stats)
    assert [g.ids for g in plain] == [g.ids for g in spec] and stats["verifications"] > 0
    # a draft layer that lost a tensor stops the load, naming the folder and the key
    del saved[n + "enorm.weight"]
    save_file(saved, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"ckpt: config.json names a GLM-5 draft layer.*enorm"):
        load_checkpoint(tmp_path / "ckpt")
    # a conversion that dropped the draft layer but kept num_nextn_predict_layers loads without one
    save_file({k: v for k, v in saved.items() if not k.startswith(n)}, str(tmp_path / "ckpt" / "model.safetensors"),
              metadata={"format": "pt"})
    assert mtp.get(load_checkpoint(tmp_path / "ckpt")[0]) is None


def test_the_w4a8_export_keeps_glm5s_draft_layer_where_glm5_keeps_it(tok, tmp_path):
    from safetensors.torch import load_file

    from posttrain.config import QuantizeConfig
    from posttrain.engines.speculative import sample_speculative
    from posttrain.engines.torch_rollout import sample
    from posttrain.models import mtp
    from posttrain.quant.int_linear import load_compressed
    from posttrain.stages.quantize import calibrate, export
    torch.manual_seed(0)
    model = mtp.install(build_model(ModelConfig(**GLM5), tok), 2).eval()
    moe.unfuse_experts(model)  # as the quantize stage holds it
    qcfg = QuantizeConfig(group_size=16)
    export(model, tok, calibrate(model, torch.randint(3, len(tok), (4, 24)), qcfg), qcfg, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.4.eh_proj.weight" in keys and not any(k.startswith("mtp.") for k in keys)
    again, _ = load_compressed(tmp_path)
    assert mtp.get(again).depth == 2
    assert torch.equal(again.mtp.proj.weight, model.mtp.proj.weight.to(again.mtp.proj.weight.dtype))
    plain = sample(again, [[5, 6, 7]], max_new_tokens=10, temperature=0, stop_ids=set(), pad_id=0)
    spec = sample_speculative(again, [[5, 6, 7]], max_new_tokens=10, temperature=0, stop_ids=set(), pad_id=0)
    assert plain[0].ids == spec[0].ids
