"""MTP: the draft layer trains as an auxiliary loss and learns to predict two tokens ahead, reloads with its
checkpoint (plain and W4A8), and speculative decoding keeps the model's own output: greedy identical to plain
decoding, sampling exactly the model's distribution with its own log-probabilities."""
import random

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from posttrain.models import mtp
from posttrain.config import ModelConfig
from posttrain.engines.speculative import sample_speculative, verify
from posttrain.engines.torch_rollout import TorchRolloutEngine, sample
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
from posttrain.engines.torch_train import TorchTrainEngine
from posttrain.train import train
from posttrain.engines.lm import masked_lm_loss


@pytest.fixture
def model(tok):
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                max_position_embeddings=256), tok)
    return mtp.install(m, 3).eval()


def counting(step: int) -> dict:
    """Rows counting up from a random start (next token = this one + 1): two tokens ahead is learnable."""
    rng = random.Random(step)
    ids = torch.tensor([[3 + (s + i) % 64 for i in range(48)] for s in [rng.randrange(64) for _ in range(8)]])
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids)}


def scramble(m) -> None:
    """A draft layer that disagrees with the model often: every rejection path runs."""
    with torch.no_grad():
        m.mtp.proj.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(1))


def test_verification_emits_exactly_the_models_distribution():
    g = torch.Generator().manual_seed(0)
    B, V = 200_000, 5
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).expand(B, V)
    q = torch.tensor([[0.05, 0.1, 0.15, 0.2, 0.5]]).expand(B, V)                   # a poor draft
    d = torch.multinomial(q[:1], B, replacement=True, generator=g).view(B, 1)
    logp = torch.stack([p, torch.full((B, V), 1 / V)], 1).log()
    kept, y = verify(logp, q[:, None], d, 1.0, g)
    first = torch.where(kept == 1, d[:, 0], y)
    freq = torch.bincount(first, minlength=V).float() / B
    assert (freq - p[0]).abs().sum() / 2 < 0.01
    assert 0.2 < kept.float().mean() < 0.8             # both paths taken
    greedy_kept, greedy_y = verify(logp, q[:, None], torch.zeros((B, 1), dtype=torch.long), 0.0)
    assert greedy_kept.eq(1).all()                      # token 0 is the argmax: kept, then the argmax after it


@pytest.mark.parametrize("variant", ["as installed", "scrambled", "dsa"])
def test_greedy_speculative_decoding_is_plain_greedy_decoding(model, variant):
    if variant != "as installed":
        scramble(model)
    if variant == "dsa":  # sparse attention over a cache with rejected slots masked out
        from posttrain.models import dsa
        dsa.install(model, top_k=4)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [5, 6, 7, 8, 9], [100] * 9]
    stop = {model.config.eos_token_id, 7}
    plain = sample(model, prompts, max_new_tokens=25, temperature=0, stop_ids=stop, pad_id=0)
    stats = {}
    spec = sample_speculative(model, prompts, max_new_tokens=25, temperature=0, stop_ids=stop, pad_id=0, stats=stats)
    for a, b in zip(plain, spec):
        assert a.ids == b.ids and a.stop_reason == b.stop_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert stats["verifications"] > 0 and stats["accepted"] >= stats["verifications"]


def test_sampled_tokens_carry_the_models_own_logprobs(model, tok):
    scramble(model)
    engine = TorchRolloutEngine(model, tok)
    prompts = [[5, 6, 7, 8, 9]] * 6 + [[40, 41]] * 6
    gens = engine.generate(prompts, max_new_tokens=20, temperature=0.8, stop_ids={model.config.eos_token_id},
                           generator=torch.Generator().manual_seed(3))
    acceptance = engine.stats["accepted"] / engine.stats["verifications"]
    assert 1 <= acceptance < 4                          # some drafts were rejected
    scored = engine.score([(p, g.ids, [1] * len(g.ids)) for p, g in zip(prompts, gens)], temperature=0.8)
    for g, s in zip(gens, scored):
        assert len(g.ids) == 20 or g.stop_reason == "stop"
        assert max(abs(a - b) for a, b in zip(g.logprobs, s)) < 1e-4
    assert len({tuple(g.ids) for g in gens}) > 2        # sampled, not greedy


def test_mtp_trains_and_speeds_up_decoding_of_what_it_learned(model, tok, tmp_path):
    before = {n: p.detach().clone() for n, p in model.mtp.named_parameters()}
    curves = train(TorchTrainEngine.for_lm(model, lr=3e-3, mtp_weight=0.5), counting, steps=60, lr=3e-3, warmup=5)
    assert all(not torch.equal(before[n], p) for n, p in model.mtp.named_parameters() if n.endswith("weight"))
    assert sum(curves["mtp_loss"][-5:]) < sum(curves["mtp_loss"][:5]) / 2
    assert sum(curves["mtp_acc1"][-5:]) / 5 > 0.9      # two tokens ahead, predicted
    batch = counting(999)  # the loss reported is the LM loss (the MTP term is a gradient only)
    assert torch.allclose(mtp.with_loss(masked_lm_loss, 0.5, {})(model, batch), masked_lm_loss(model, batch))
    stats = {}
    sample_speculative(model, [[10, 11, 12, 13]] * 4, max_new_tokens=30, temperature=0, stop_ids=set(), pad_id=0,
                       stats=stats)
    assert stats["accepted"] / stats["verifications"] >= 3   # of at most 4 (3 drafts + the model's token)
    # kept in the checkpoint: the reloaded model drafts the same
    save_checkpoint(model, tok, tmp_path)
    again, _ = load_checkpoint(tmp_path)
    assert mtp.get(again).depth == 3
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in again.named_parameters()
               if n.startswith("mtp."))


def test_the_w4a8_export_keeps_the_mtp_layer_unquantized(model, tok, tmp_path):
    from posttrain.config import QuantizeConfig
    from posttrain.quant.int_linear import load_compressed
    from posttrain.stages.quantize import calibrate, export
    qcfg = QuantizeConfig(group_size=64)
    export(model, tok, calibrate(model, counting(0)["input_ids"][:, :32], qcfg), qcfg, tmp_path)
    again, _ = load_compressed(tmp_path)
    assert isinstance(again.mtp.layer.mlp.up_proj, torch.nn.Linear) and mtp.get(again).depth == 3
    plain = sample(again, [[5, 6, 7]], max_new_tokens=12, temperature=0, stop_ids=set(), pad_id=0)
    spec = sample_speculative(again, [[5, 6, 7]], max_new_tokens=12, temperature=0, stop_ids=set(), pad_id=0)
    assert plain[0].ids == spec[0].ids


def test_an_mtp_layer_needs_a_plain_output_head(model):
    model.config.final_logit_softcapping = 30.0
    del model.mtp
    with pytest.raises(ValueError, match="shares that head"):
        mtp.install(model, 2)


def test_the_mtp_layer_runs_fused_norms_only_where_they_compute_the_same(model):
    class OnePlusNorm(torch.nn.Module):  # Gemma's form: x * (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.randn(8)), 1e-6

        def forward(self, x):
            return torch.nn.functional.rms_norm(x, (8,), eps=self.variance_epsilon) * (1 + self.weight)

    layer = mtp.get(model)
    assert isinstance(layer.norm_h, mtp._FusedRMSNorm) and isinstance(layer.layer.input_layernorm, mtp._FusedRMSNorm)
    assert {k for k in layer.state_dict() if "norm" in k} >= {"norm_h.weight", "layer.input_layernorm.weight"}
    holder = torch.nn.Module()
    holder.norm = OnePlusNorm()
    holder.bf16 = LlamaRMSNorm(64).to(torch.bfloat16)  # a real checkpoint's dtype: fused too
    mtp._fuse_norms(holder)
    assert isinstance(holder.norm, OnePlusNorm) and isinstance(holder.bf16, mtp._FusedRMSNorm)
