"""GLM-5's architecture through the engines: stable DSA selection, the indexed decode cache, rollout = trainer."""
from types import SimpleNamespace

import pytest
import torch

from posttrain.models import attention, dsa, glm5
from posttrain.engines.torch_rollout import sample
from posttrain.models.prefix import prefix_forward
from tests.test_megatron import forward_tol, threads
from tests.test_moe import tiny_glm


def sparse_glm(seed: int = 0, top_k: int = 8):
    """The toy with DSA selecting `top_k` keys per query (fewer than the sequences here), stably: built by
    transformers, so its indexers are made posttrain's as every model posttrain builds or loads has them."""
    model = glm5.stable_indexers(tiny_glm(seed).eval())
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = top_k
    return model


def test_the_stable_selection_is_bound_to_posttrains_models_only(tok, tmp_path):
    """No library method is replaced: a GLM-5 that transformers builds on its own keeps transformers' indexer,
    while every model posttrain builds or loads (the preset, a checkpoint, a W4A8 export, the MTP layer's own
    indexer) has the stable one on its own modules."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    from posttrain.config import ModelConfig, QuantizeConfig
    from posttrain.models import moe, mtp
    from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
    from posttrain.quant.int_linear import load_compressed
    from posttrain.stages.quantize import calibrate, export
    from tests.test_glm5_model import GLM5
    library = GlmMoeDsaIndexer.forward

    def indexers(model):
        return [m for m in model.modules() if isinstance(m, GlmMoeDsaIndexer)]

    torch.manual_seed(0)
    ours = mtp.install(build_model(ModelConfig(**GLM5), tok), 1)
    save_checkpoint(ours, tok, tmp_path / "ckpt")
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    moe.unfuse_experts(loaded)  # as the quantize stage holds it
    qcfg = QuantizeConfig(group_size=16)
    export(loaded, tok, calibrate(loaded, torch.randint(3, len(tok), (2, 16)), qcfg), qcfg, tmp_path / "q")
    quantized, _ = load_compressed(tmp_path / "q")
    theirs = tiny_glm()
    for model in (ours, load_checkpoint(tmp_path / "ckpt")[0], quantized):
        assert all(type(m) is glm5.StableIndexer for m in indexers(model))
        assert indexers(model.mtp) and len(indexers(model)) == 4  # three full layers and the MTP layer's own
    assert GlmMoeDsaIndexer.forward is library
    assert indexers(theirs) and all(type(m) is GlmMoeDsaIndexer and m.forward.__func__ is library
                                    for m in indexers(theirs))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dsa_selection_does_not_depend_on_the_sequence_length(seed):
    model = sparse_glm(seed)
    x = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), threads(1):  # the two lengths at other thread counts too: their sums block otherwise
        full = model(input_ids=x).logits
    with torch.no_grad(), threads(2):
        part = model(input_ids=x[:, :45]).logits
    torch.testing.assert_close(part, full[:, :45], rtol=0, atol=forward_tol(full.abs().max().item(), model.config))


def test_batched_left_padded_greedy_sampling_equals_transformers_generate():
    model = sparse_glm()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [11, 12, 13], [40, 41, 42, 43, 44, 45]]
    got = sample(model, prompts, max_new_tokens=12, temperature=0.0, stop_ids={2}, pad_id=0)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert g.ids == ref[:len(g.ids)] and len(g.ids) == len(ref)
        assert g.stop_reason == ("stop" if ref[-1] == 2 else "length")


def test_a_sampled_group_shares_its_prompt_and_the_logprobs_are_the_trainers():
    model = sparse_glm()
    prompts = [[5, 6, 7, 8, 9]] * 4 + [[20, 21, 22]] * 4
    with threads(1):  # the rollout at one thread, the trainer's forward at two: their sums block otherwise
        gens = sample(model, prompts, max_new_tokens=10, temperature=1.0, stop_ids={2}, pad_id=0,
                      generator=torch.Generator().manual_seed(0))
    assert len({tuple(g.ids) for g in gens}) > 2  # sampled, not copies of one row
    samples = [SimpleNamespace(prompt_ids=p, ids=g.ids) for p, g in zip(prompts, gens)]
    with threads(2):
        logits = prefix_forward(model, samples, pad_id=0)
    for i, (s, g) in enumerate(zip(samples, gens)):
        lp = torch.log_softmax(logits[i, :len(s.ids)].float(), -1).gather(1, torch.tensor(s.ids)[:, None])[:, 0]
        want = torch.tensor(g.logprobs)
        torch.testing.assert_close(lp, want, rtol=0, atol=forward_tol(want.abs().max().item(), model.config))


def test_prefix_forward_equals_the_whole_sequence_and_trains():
    model = sparse_glm().train()
    samples = [SimpleNamespace(prompt_ids=[5, 6, 7, 8, 9, 10], ids=[30, 31, 32, 33]),
               SimpleNamespace(prompt_ids=[11, 12], ids=[40, 41, 42, 43, 44, 45, 46])]
    with threads(2):  # the whole rows at one thread: their sums block otherwise
        logits = prefix_forward(model, samples, pad_id=0)
    for i, s in enumerate(samples):
        with threads(1):
            whole = model(input_ids=torch.tensor([s.prompt_ids + s.ids])).logits[0]
        want = whole[len(s.prompt_ids) - 1:len(s.prompt_ids) - 1 + len(s.ids)]
        torch.testing.assert_close(logits[i, :len(s.ids)], want, rtol=0,
                                   atol=forward_tol(want.abs().max().item(), model.config))
    logits.sum().backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_glm5_keeps_padded_batches_and_refuses_attention_without_a_full_mask():
    model = sparse_glm()
    assert not attention.padding_free(model)
    attention.fast_decoding(model)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="GLM-5's DSA indexer"):
        attention.use(model, "packed_sdpa")


def test_a_saved_glm5_checkpoint_generates_through_the_rollout_engine(tok, tmp_path):
    from posttrain.config import ModelConfig
    from posttrain.engines import rollout_engine
    from posttrain.models.preset import build_model, save_checkpoint
    from tests.test_glm5_model import GLM5
    save_checkpoint(build_model(ModelConfig(**GLM5), tok), tok, tmp_path)
    engine = rollout_engine("torch", tmp_path)
    gens = engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=6, temperature=0.0, stop_ids={tok.eos_token_id})
    for g in gens:
        assert (g.stop_reason == "stop" and g.ids[-1] == tok.eos_token_id) or (g.stop_reason == "length"
                                                                               and len(g.ids) == 6)
        assert len(g.logprobs) == len(g.ids) and all(lp <= 0 for lp in g.logprobs)
    # rl.rollout_dtype w4a8: its routed experts in int4 (one grouped module a layer), recording routes for replay
    from posttrain.quant.int_experts import IntExperts
    w4a8 = rollout_engine("torch", tmp_path, "w4a8")
    assert sum(isinstance(m, IntExperts) for m in w4a8.model.modules()) == 3
    w4a8.record_routes()
    (g,) = w4a8.generate([[5, 6, 7]], max_new_tokens=4, temperature=0.0, stop_ids=set())
    assert len(g.ids) == 4 and g.routes is not None


def test_packed_training_rows_keep_their_documents_apart():
    from posttrain.models.head import sequence_logprobs
    from posttrain.packing import collate
    model = sparse_glm(top_k=64)
    a, b = list(range(5, 25)), list(range(40, 52))
    batch = collate([[(a, [1.0] * len(a)), (b, [1.0] * len(b))]], 0)
    with torch.no_grad(), threads(1):  # the packed row at one thread, the document alone at two
        packed = sequence_logprobs(model, batch["input_ids"], batch["loss_mask"], position_ids=batch["position_ids"])
    with torch.no_grad(), threads(2):
        alone = sequence_logprobs(model, torch.tensor([b]), torch.ones(1, len(b)))
    torch.testing.assert_close(packed[-len(alone):], alone, rtol=0,
                               atol=forward_tol(alone.abs().max().item(), model.config))


def test_a_dense_indexer_skips_its_scores_and_changes_nothing(monkeypatch):
    """Before DSA is adopted every key is selected whatever the indexer scores, so the indexer is not run (half of
    a 16 x 512 training step on the tiny profile): logits and gradients are those of the scored selection,
    exactly, padding included."""
    model = glm5.stable_indexers(tiny_glm(0))
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding

    def run():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        out.logits.square().mean().backward()
        return out.logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    calls = []
    scored = glm5._indexer_forward
    monkeypatch.setattr(glm5, "_indexer_forward", lambda *a, **k: calls.append(1) or scored(*a, **k))
    skipped = run()
    assert not calls
    monkeypatch.setattr(glm5, "_selects_every_key", lambda *a: False)
    full = run()
    assert calls
    assert torch.equal(skipped[0], full[0])
    assert len(skipped[1]) == len(full[1]) and all(torch.equal(a, b) for a, b in zip(skipped[1], full[1]))


def test_the_indexers_kl_skips_batches_whose_selection_keeps_every_key():
    """`ramp.dsa.kl_min_keys`: a batch no wider than it trains the indexers on no KL (top_k keeps every key there:
    the selection decides nothing), a wider one does; the shared layer never scores a narrow batch with the
    indexer closure of an earlier wide one."""
    model = tiny_glm(0)
    glm5.install_dsa(model, top_k=8, kl_queries=4)
    st = dsa.state(model)
    st.collect, st.kl_min_keys = True, 8
    wide, narrow = (torch.randint(3, model.config.vocab_size, (2, n)) for n in (16, 8))
    model(input_ids=wide, use_cache=False)
    per_wide = len(st.losses)
    assert per_wide == 4  # every layer, the shared one (2) on layer 1's indexer
    model(input_ids=narrow, use_cache=False)
    assert len(st.losses) == per_wide
    st.pop()
    model(input_ids=narrow, use_cache=False)
    assert st.pop()[0] is None
    st.kl_min_keys = 0
    model(input_ids=narrow, use_cache=False)
    assert st.pop()[0] is not None
