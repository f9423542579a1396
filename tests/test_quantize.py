import torch

from posttrain.chat import train_tokenizer
from posttrain.config import ModelConfig, QuantizeConfig
from posttrain.model import build_model, save_checkpoint
from posttrain.quantize import dequantize_weight, load_quantized, pack_int4, quantize_weight, unpack_int4


def test_int4_pack_roundtrip_and_error_bounds():
    w = torch.randn(16, 64)
    q, s = quantize_weight(w, 4, 32)
    assert q.min() >= -8 and q.max() <= 7
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    err = (dequantize_weight(q, s) - w).abs().max() / w.abs().max()
    assert err < 0.15
    q8, s8 = quantize_weight(w, 8, 64)
    assert (dequantize_weight(q8, s8) - w).abs().max() < (dequantize_weight(q, s) - w).abs().max()


def test_quantized_checkpoint_stores_ints_and_tracks_fp32_model(tmp_path):
    from posttrain import quantize
    torch.manual_seed(0)
    tok = train_tokenizer(["hello world 1 2 3"] * 10, 300)
    model = build_model(ModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128), tok).eval()
    save_checkpoint(model, tok, tmp_path / "fp")
    cfg = type("C", (), {"quantize": QuantizeConfig(), "seed": 0})()
    out = tmp_path / "q"
    out.mkdir()
    stats = quantize.run(cfg, {"opd": str(tmp_path / "fp")}, out)["metrics"]
    assert stats["compression"] > 4
    from safetensors.torch import load_file
    t = load_file(out / "model.safetensors")
    assert t["model.layers.0.mlp.up_proj.qweight"].dtype == torch.uint8
    assert t["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.int8
    qmodel, _ = load_quantized(out)
    x = torch.randint(0, len(tok), (2, 12))
    a, b = model(x).logits, qmodel(x).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98
