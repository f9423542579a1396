"""Settings a checkpoint's own shapes decide fail before the first stage (posttrain/checkpoint_rules.py, through the
CLI's check of base.init_from), each naming the key, the checkpoint's config.json and what is allowed. The odd
checkpoint is GLM-5-shaped but not the preset's: 6 routed experts top-3, an expert width of 48, indexers laid out
full, shared, full, shared."""
import json

import pytest

from posttrain.cli import _check_local_inputs, main
from posttrain.config import ConfigError, ModelConfig, config_from_dict, load_config
from posttrain.models.preset import build_model, save_checkpoint

ODD = dict(arch="glm5", hidden_size=96, num_layers=4, num_heads=2, intermediate_size=64, moe_intermediate_size=48,
           n_routed_experts=6, num_experts_per_tok=3, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=8, index_heads=2, index_head_dim=8,
           indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=64)
DIVISORS_48 = "a divisor of 48: 1, 2, 3, 4, 6, 8, 12, 16, 24, 48"


@pytest.fixture(scope="module")
def odd(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("odd-glm5")
    save_checkpoint(build_model(ModelConfig(**ODD), tok), tok, path)
    return path


@pytest.fixture(scope="module")
def dense(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    save_checkpoint(build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok),
                    tok, path)
    return path


def refused(path, *sets: str) -> str:
    """The message of the CLI's check before the first stage (smoke profile, base.init_from=path)."""
    cfg = load_config("smoke-dense", [f"base.init_from={path}", *sets])
    with pytest.raises(ConfigError) as e:
        _check_local_inputs(cfg)
    return str(e.value)


def test_the_odd_checkpoint_gets_sdpa_and_passes_with_a_group_size_that_divides(odd):
    cfg = load_config("smoke-dense", [f"base.init_from={odd}", "quantize.group_size=16"])
    assert cfg.ramp.attention == "sdpa"  # smoke never sets it: GLM-5's choice, not the dense default
    _check_local_inputs(cfg)
    # the run's saved config says what runs: reloaded, every field is set, and it stays sdpa
    assert config_from_dict(json.loads(cfg.model_dump_json())).ramp.attention == "sdpa"
    assert load_config("smoke-dense").ramp.attention == "packed_sdpa"  # a dense model keeps the default
    preset = load_config("smoke-dense", ["model.arch=glm5", "model.num_layers=2", "quantize.group_size=16"])
    assert preset.ramp.attention == "sdpa"  # the glm5 preset alike


def test_both_settings_of_the_issue_fail_together_before_any_stage(odd):
    msg = refused(odd, "ramp.attention=packed_sdpa")  # set explicitly: refused, not replaced
    lines = msg.splitlines()
    assert lines[0].startswith(f"ramp.attention: {odd / 'config.json'}: 'packed_sdpa' with a GLM-5 checkpoint")
    assert "allowed: sdpa, eager, dsa" in lines[0]
    assert lines[1].strip().startswith(f"quantize.group_size: {odd / 'config.json'}: 32 does not divide "
                                       f"mlp.experts.*.down_proj's 48 input columns")
    assert DIVISORS_48 in lines[1] and "moe_intermediate_size 48" in lines[1]


def test_the_in_process_cli_refuses_with_one_line_and_writes_nothing(odd, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    assert main(["run", "--profile", "smoke-dense", "--set", f"base.init_from={odd}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posttrain: error: quantize.group_size: {odd / 'config.json'}: 32") and DIVISORS_48 in err
    assert not list(tmp_path.iterdir())


def test_the_quantize_stage_refuses_with_the_same_rule_and_the_same_widths(tok):
    from posttrain.checkpoint_rules import int4_widths, module_pattern
    from posttrain.config import QuantizeConfig
    from posttrain.models import moe
    from posttrain.stages.quantize import targets
    model = build_model(ModelConfig(**ODD), tok)
    moe.unfuse_experts(model)
    with pytest.raises(ValueError, match=r"quantize.group_size=32 does not divide model\.layers\.\*\.mlp\.experts\.\*"
                                         r"\.down_proj's 48 input columns; allowed: " + DIVISORS_48):
        targets(model, QuantizeConfig(group_size=32))
    found = targets(model, QuantizeConfig(group_size=16))
    int4 = {module_pattern(n): m.in_features for n, (m, bits, _) in found.items() if bits == 4}
    assert sorted(set(int4.values())) == sorted({w for _, w in int4_widths(model.config).values()}) == [48, 96]
    dense = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=96), tok)
    int4 = {m.in_features for m, bits, _ in targets(dense, QuantizeConfig(group_size=16)).values() if bits == 4}
    assert int4 == {w for _, w in int4_widths(dense.config).values()} == {32, 96}


def test_the_megatron_split_is_checked_against_the_checkpoint(odd):
    dsa = ["runtime.train_engine=megatron", "sft.workers=4", "ramp.attention=dsa", "ramp.dsa.top_k=32"]
    msg = refused(odd, *dsa, "megatron.pp=4", "quantize.group_size=16")
    assert msg.startswith(f"megatron.pp: {odd / 'config.json'}: layer 1 shares layer 0's DSA selection")
    assert msg.endswith("allowed: 1, 2")
    msg = refused(odd, "runtime.train_engine=megatron", "sft.workers=4", "megatron.ep=4", "quantize.group_size=16")
    assert msg.startswith(f"megatron.ep: {odd / 'config.json'}: must divide the checkpoint's n_routed_experts (6)")
    assert "supported: [1, 2, 3, 6]" in msg
    fits = load_config("smoke-dense", [f"base.init_from={odd}", *dsa, "megatron.pp=2", "quantize.group_size=16"])
    _check_local_inputs(fits)


def test_glm5s_own_indexers_refuse_ramp_dsas_layout(odd):
    msg = refused(odd, "ramp.attention=dsa", "ramp.dsa={top_k: 32, heads: 2}", "quantize.group_size=16")
    assert msg.startswith(f"ramp.dsa.heads: {odd / 'config.json'}: GLM-5's own indexers are laid out by the "
                          f"checkpoint's indexer_types (full, shared, full, shared)")
    assert "allowed: unset (the default 4)" in msg


def test_the_ramp_stage_refuses_by_the_same_rule_before_reading_anything(odd, tmp_path):
    from posttrain.stages import ramp
    cfg = load_config("smoke-dense", [f"base.init_from={odd}", "ramp.attention=packed_sdpa"])
    with pytest.raises(ValueError, match=r"ramp.attention: .*'packed_sdpa' with a GLM-5 checkpoint .*allowed: sdpa"):
        ramp.run(cfg, {"base": str(odd), "curate": str(tmp_path / "not-there")}, tmp_path / "out")


DENSE_RULES = [
    (["ramp.attention=dsa", "ramp.dsa={top_k: 32, own_indexer: [0, 5]}"], "ramp.dsa.own_indexer",
     "allowed: layer indices 0 to 1"),
    (["rl.routing_replay=true"], "rl.routing_replay", "allowed: false"),
    (["ramp.stages=[{seq_len: 96, tokens: 384, rope_theta: 2.0e+4, rope_scaling: {rope_type: yarn}}]"],
     "ramp.stages.0.rope_scaling", "or a rope_type of dynamic, linear"),
    (["runtime.train_engine=megatron", "megatron.tp=4", "sft.workers=4"], "megatron.tp", "supported: [1, 2]"),
    (["runtime.train_engine=megatron", "megatron.pp=3", "sft.workers=3"], "megatron.pp", "allowed: 1, 2"),
    (["quantize.group_size=48"], "quantize.group_size", "allowed: a divisor of 32: 1, 2, 4, 8, 16, 32"),
    (["quantize.int8_layers=[1, 2]"], "quantize.int8_layers", "[2] are not layers of this model; allowed: 0 to 1"),
]


@pytest.mark.parametrize("sets, key, allowed", DENSE_RULES, ids=[key for _, key, _ in DENSE_RULES])
def test_a_dense_checkpoints_rules(dense, sets, key, allowed):
    msg = refused(dense, *sets)
    assert msg.startswith(f"{key}: {dense / 'config.json'}: ") and allowed in msg, msg


def test_a_draft_layer_needs_a_plain_head(dense, tmp_path):
    import shutil
    path = tmp_path / "scaled"
    shutil.copytree(dense, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"final_logit_softcapping": 30.0}))
    assert refused(path, "mtp.depth=1") == (f"mtp.depth: {path / 'config.json'}: the draft layer shares the output "
                                            f"head, and the checkpoint scales its logits (final_logit_softcapping "
                                            f"30.0); allowed: 0")


@pytest.mark.parametrize("profile", ["smoke", "smoke-dense", "tiny", "tiny-dense"])
def test_a_profiles_own_preset_passes_as_a_checkpoint(profile, tok, tmp_path):
    cfg = load_config(profile)
    _check_local_inputs(cfg)  # no base.init_from: nothing to read
    save_checkpoint(build_model(cfg.model, tok), tok, tmp_path)
    _check_local_inputs(load_config(profile, [f"base.init_from={tmp_path}"]))


def test_a_router_that_cannot_pick_its_experts_is_refused(odd, tmp_path):
    import shutil
    path = tmp_path / "top7"
    shutil.copytree(odd, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 7}))
    assert refused(path, "quantize.group_size=16") == (f"base.init_from: {path / 'config.json'}: num_experts_per_tok "
                                                       f"7 > n_routed_experts 6; allowed: 1 to 6")
