import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.chat import train_tokenizer
from posttrain.config import ModelConfig, QuantizeConfig
from posttrain.quant.gptq import HessianTracker, gptq, rtn
from posttrain.quant.int_linear import IntLinear, load_compressed
from posttrain.quant.int_matmul import CPU_ROWS, EXACT_FLOAT32_K
from posttrain.models.preset import build_model, save_checkpoint
from posttrain.stages.quantize import calibrate, export, linear_bytes, load_checks, targets


def test_int_linear_matches_the_dequantized_matmul_on_int8_activations():
    torch.manual_seed(0)
    w, x = torch.randn(24, 64), torch.randn(3, 5, 64)
    q, s = rtn(w, 4, 16, torch.float32)
    layer = IntLinear(q, s)
    deq = (q.float().reshape(24, 4, 16) * s[..., None]).reshape(24, 64)
    sx = x.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x / sx) * sx  # what the int8 kernel sees
    assert layer.qweight_t.dtype == torch.int8
    assert torch.allclose(layer(x), xq @ deq.T, atol=1e-4)
    assert (layer(x) - x @ w.T).abs().mean() / (x @ w.T).abs().mean() < 0.15


@pytest.mark.parametrize("k", [EXACT_FLOAT32_K, 4 * EXACT_FLOAT32_K])
def test_cpu_integer_matmul_is_exact_at_the_largest_sums(k):
    """The CPU path runs int8 x int8 as a float GEMM: each group's sum exact even where every product is the largest,
    so the layer gives the integer result rounded once, as the int64 product does."""
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (7, k), dtype=torch.int8)
    q[0], q[1], q[1, 0] = -128, -127, -126  # row 1's sum is odd: past 2^24 float32 sums cannot hold it
    x = torch.randint(0, 2, (5, k)).float() * 2 - 1
    x[0] = -1  # quantized per token: every activation +-127
    layer = IntLinear(q, torch.ones(7, 1))
    xq = torch.round(x / (1 / 127)).long()
    exact = xq @ q.long().T
    assert exact[0, 0] == k * 127 * 128 and exact[0, 1] % 2 == 1
    assert torch.equal(layer(x), exact.float() * (x.abs().amax(-1, keepdim=True) / 127))


def test_cpu_integer_matmul_gives_each_row_the_same_bits_in_any_batch():
    """A prefill's rows run in chunks (CPU_ROWS): a row's output is the one it gets alone, so a prompt scores the
    same whatever it is batched with."""
    torch.manual_seed(0)
    q, s = rtn(torch.randn(40, 128), 4, 32, torch.float32)
    layer, x = IntLinear(q, s), torch.randn(2 * CPU_ROWS + 5, 128)
    assert torch.equal(layer(x), torch.cat([layer(r[None]) for r in x]))


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    torch.manual_seed(0)
    mix = torch.randn(64, 64) * torch.linspace(0.1, 3, 64)
    x = torch.randn(4096, 64) @ mix  # correlated, uneven input features like real activations
    w = torch.randn(32, 64)
    tracker = HessianTracker({"l": torch.nn.Linear(64, 32)})
    tracker.handles[0].remove()
    tracker._hook("l")(None, (x,))
    h = tracker.close()["l"]

    def out_err(q, s):
        deq = (q.float().reshape(32, -1, 16) * s[..., None]).reshape(32, 64)
        return ((x @ (deq - w).T) ** 2).mean().item()
    q_g, s_g = gptq(w, h, 4, 16, torch.bfloat16)
    q_r, s_r = rtn(w, 4, 16, torch.bfloat16)
    assert q_g.min() >= -8 and q_g.max() <= 7
    assert torch.equal(s_g.to(torch.bfloat16).float(), s_g)  # scales exact in the export dtype
    assert out_err(q_g, s_g) < 0.8 * out_err(q_r, s_r)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("q")
    tok = train_tokenizer(["hello world 1 2 3 the answer is 42"] * 20, 300)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=512)
    model = build_model(cfg, tok).eval()
    save_checkpoint(model, tok, tmp / "fp")
    qcfg = QuantizeConfig(group_size=64)
    rows = torch.randint(0, len(tok), (16, 32))
    ref = build_model(cfg, tok).eval()
    ref.load_state_dict(model.state_dict())
    ints = calibrate(model, rows, qcfg)
    export(model, tok, ints, qcfg, tmp / "q")
    return ref, tok, tmp / "fp", tmp / "q", list(ints)


def test_export_is_compressed_tensors_w4a8_that_runs_on_integer_kernels(exported):
    ref, tok, _, qdir, names = exported
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    by_format = {g["format"]: g for g in qc["config_groups"].values()}
    mlp, attn = by_format["pack-quantized"], by_format["int-quantized"]
    assert (mlp["weights"]["num_bits"], mlp["weights"]["group_size"], mlp["targets"]) == (4, 64, [r"re:.*mlp\.(gate|up|down)_proj$"])
    assert (attn["weights"]["num_bits"], attn["weights"]["strategy"]) == (8, "channel")
    assert mlp["input_activations"]["dynamic"] and mlp["input_activations"]["strategy"] == "token"
    t = load_file(qdir / "model.safetensors")
    assert t["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert t["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.bfloat16
    model, _ = load_compressed(qdir)
    assert isinstance(model.model.layers[1].mlp.down_proj, IntLinear)
    x = torch.randint(0, len(tok), (2, 12))
    a, b = ref(x).logits, model(x).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98
    # int4 MLP and int8 attention at bf16 scales: well under half of bf16 for an MLP-heavy model
    bf16 = sum(ref.get_submodule(n).weight.numel() * 2 for n in names)
    assert linear_bytes(qdir, names) / bf16 < 0.33


def test_transformers_decompresses_the_export_to_the_same_model(exported):
    """The serving engines' reading of the format (transformers' compressed-tensors quantizer, which
    dequantizes) agrees with our integer-kernel model: the export is not a private format."""
    from transformers import AutoModelForCausalLM
    _, tok, _, qdir, _ = exported
    hf = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32).eval()
    ours, _ = load_compressed(qdir)
    x = torch.randint(0, len(tok), (2, 12))
    with torch.no_grad():
        a, b = hf(x).logits, ours(x).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_export_reloads_and_generates_in_a_fresh_process(exported):
    _, _, fp, qdir, _ = exported
    q, f = load_checks([qdir, fp], "hello world")
    assert q["generated_tokens"] > 0 and q["peak_rss_bytes"] > 0
    assert q["model_bytes"] < 0.5 * f["model_bytes"]


def test_group_size_that_does_not_divide_is_refused():
    tok = train_tokenizer(["a b c"] * 5, 280)
    model = build_model(ModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=96), tok)
    with pytest.raises(ValueError, match="group_size=64 does not divide .*down_proj's 96"):
        targets(model, QuantizeConfig(group_size=64))


def test_int8_layers_keep_their_mlp_at_int8_channels_in_the_export_and_its_reload(tmp_path):
    torch.manual_seed(0)
    tok = train_tokenizer(["hello world 1 2 3 the answer is 42"] * 20, 300)
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=1, intermediate_size=128)
    model = build_model(cfg, tok).eval()
    with pytest.raises(ValueError, match=r"quantize.int8_layers: \[3\] are not layers of this model \(it has 3"):
        targets(model, QuantizeConfig(group_size=64, int8_layers=[3]))
    qcfg = QuantizeConfig(group_size=64, int8_layers=[1])
    found = targets(model, qcfg)
    assert {(b, g) for n, (_, b, g) in found.items() if ".mlp." in n and ".1." not in n} == {(4, 64)}
    assert found["model.layers.1.mlp.down_proj"][1:] == (8, 128)
    ints = calibrate(model, torch.randint(0, len(tok), (8, 16)), qcfg)
    export(model, tok, ints, qcfg, tmp_path / "q")  # checks every integer survives the export
    t = load_file(tmp_path / "q" / "model.safetensors")
    assert t["model.layers.1.mlp.up_proj.weight"].dtype == torch.int8
    assert "model.layers.2.mlp.up_proj.weight_packed" in t
    reloaded, _ = load_compressed(tmp_path / "q")
    assert reloaded.model.layers[1].mlp.up_proj.qweight_t.abs().max() > 8  # int8's range, not int4's
    assert reloaded.model.layers[2].mlp.up_proj.qweight_t.abs().max() <= 8


def test_everyday_instructions_join_the_calibration_stream_among_the_conversations(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import environments
    from posttrain import replay
    from posttrain.config import load_config
    from posttrain.stages.quantize import calibration_rows
    for d in environments.DOMAINS:
        ts = environments.get(d).generate("train", 8, 0)
        pq.write_table(pa.Table.from_pylist([{"id": t.id, "task": t.to_json()} for t in ts]), tmp_path / f"sft-{d}.parquet")
    plain = calibration_rows(load_config("smoke-dense", ["quantize.calib_seq_len=16"]), str(tmp_path), tok)
    mixed = calibration_rows(load_config("smoke-dense", ["quantize.calib_seq_len=16", "quantize.calib_everyday=4"]),
                             str(tmp_path), tok)
    assert mixed.numel() > plain.numel()
    text = tok.decode(mixed.flatten())
    assert all(p in text for p in replay.PROMPTS[:4]) and replay.PROMPTS[4] not in text
    assert text.index(replay.PROMPTS[3]) < len(text) * 0.9  # spread through, not appended at the end


@pytest.mark.parametrize("arch", ["llama", "glm5"])
def test_calibration_passes_activations_one_decoder_layer_at_a_time_as_the_whole_model_would(arch):
    """GPTQ calibrates each layer on its predecessors' outputs by running the captured activations through one
    layer at a time (a forward of the whole model per layer was quadratic in depth): chained over every layer they
    are the model's own last hidden states, each layer with its own mask and position embeddings."""
    from posttrain.quant.layerwise import layer_inputs, through
    from tests.test_glm5_model import GLM5
    torch.manual_seed(0)
    tok = train_tokenizer(["hello world 1 2 3 the answer is 42"] * 20, 300)
    cfg = ModelConfig(**GLM5) if arch == "glm5" else ModelConfig(hidden_size=64, num_layers=3, num_heads=4,
                                                                  num_kv_heads=1, intermediate_size=128)
    model = build_model(cfg, tok).eval()
    if arch == "llama":
        model = model.double()  # float64: the two paths' sums agree far below the bound
    rows = torch.randint(0, len(tok), (6, 24))
    seen = []
    model.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        hidden, kwargs = layer_inputs(model, rows, batch=3)
        assert len(hidden) == 2 and all(len(kw) == cfg.num_layers for kw in kwargs)
        for li, layer in enumerate(model.model.layers):
            hidden = [through(layer, h, kw[li]) for h, kw in zip(hidden, kwargs)]
        for i, h in enumerate(hidden):
            model(rows[3 * i:3 * i + 3], use_cache=False)
            want = seen[-1]
            # float32 (GLM-5's grouped expert matmul has no float64): a few ulps of the activations' scale
            tol = 1e-10 if arch == "llama" else 1e-5
            assert (h - want).abs().max() <= tol * want.abs().max()
