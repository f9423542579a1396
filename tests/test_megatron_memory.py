"""The memory arithmetic behind docs/megatron.md's table of what fits on 8 x 80 GB: parameter counts equal the
models', layouts divide what they split, and one megatron step measured by torch's memory profiler matches it."""
import pytest
import torch

from bench.megatron_memory import Layout, Shape, per_gpu

pytestmark = pytest.mark.usefixtures("megatron_groups")  # the measured step opens the engine's world of one


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_parameter_counts_equal_the_models(kind):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(kind, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=96, vocab_size=300, head_dim=16, tie_word_embeddings=kind != "llama")
    model = AutoModelForCausalLM.from_config(cfg)
    assert Shape.from_config(cfg.to_dict()).params() == sum(p.numel() for p in model.parameters())


def test_each_layout_divides_what_it_splits():
    s = Shape(hidden=1024, layers=8, heads=16, kv_heads=4, ffn=2816, vocab=32000)
    one = per_gpu(s, Layout(), 8192)
    tp = per_gpu(s, Layout(tp=2, dp=4, distributed_optimizer=True), 8192)
    assert tp["weights"] == pytest.approx(one["weights"] / 2, rel=1e-3)  # norms are a rounding error
    assert tp["optimizer"] == pytest.approx(one["optimizer"] / 8, rel=1e-3)  # and sharded over dp 4
    cp = per_gpu(s, Layout(cp=4), 8192)
    assert cp["weights"] == one["weights"] and cp["activations"] == pytest.approx(one["activations"] / 4)
    assert cp["logits"] == pytest.approx(one["logits"] / 4)
    assert per_gpu(s, Layout(recompute=True), 8192)["activations"] < one["activations"] / 4
    pp = per_gpu(s, Layout(pp=2), 8192, micro_batches=8)
    assert pp["weights"] < one["weights"] and pp["activations"] == pytest.approx(one["activations"], rel=0.01)


def test_a_megatron_step_measured_by_the_profiler_matches_the_arithmetic(tmp_path):
    """Weights, gradients and AdamW's state exactly; with recompute (what the `real` profile runs) the activations
    and logits within 10%."""
    from transformers import AutoConfig

    from bench.megatron import checkpoint
    from bench.megatron_memory import measure
    path = checkpoint("tiny", tmp_path)
    shape = Shape.from_config(AutoConfig.from_pretrained(path).to_dict())
    got = measure(path, 256, recompute=True)
    est = per_gpu(shape, Layout(recompute=True), 256, precision="fp32")
    for k in ("weights", "gradients", "optimizer"):
        assert got[k] == pytest.approx(est[k], rel=0.01), k
    assert got["activations"] == pytest.approx(est["activations"] + est["logits"], rel=0.1)
