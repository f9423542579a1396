"""ramp: packed documents stay independent, the attention seam, activation checkpointing, the ladder config."""
import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.models import attention, packed_attention
from posttrain.config import ConfigError, load_config
from posttrain.packing import collate, pack
from posttrain.engines.lm import masked_lm_loss


def tiny_llama(attn: str = "sdpa", kv_heads: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, intermediate_size=64, max_position_embeddings=128)
    return attention.use(LlamaForCausalLM(cfg), attn)


def doc(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    return [rng.randrange(1, 64) for _ in range(n)], [1] * n


@pytest.mark.parametrize("attn", ["sdpa", "eager", "packed_sdpa"])
def test_attention_never_crosses_packed_documents(attn, monkeypatch):
    """A document's outputs are unchanged, to float precision, when the other documents in its row change
    (content and length); without document masks they do change."""
    monkeypatch.setattr(packed_attention, "MIN_LEN", 8)  # these rows are short: take packed_sdpa's own path
    model = tiny_llama(attn).eval()
    rng = random.Random(0)
    target = doc(rng, 17)

    def target_logits(mask_documents: bool, before: int, after: int) -> torch.Tensor:
        row = [doc(rng, before), target, doc(rng, after)]
        b = collate([row], 0, mask_documents=mask_documents)
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        return logits[0, before:before + 17]

    alone = model(input_ids=torch.tensor([target[0]])).logits[0].detach()
    for before, after in [(5, 9), (30, 2), (1, 40)]:
        torch.testing.assert_close(target_logits(True, before, after), alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(target_logits(False, 5, 9), target_logits(False, 30, 2), atol=1e-3)


def test_pack_keeps_every_token_and_restarts_positions():
    rng = random.Random(1)
    docs = [doc(rng, n) for n in [3, 50, 64, 100, 7, 7, 30]]  # 100 > seq_len: cut into 64 + 36
    rows = pack(docs, 64)
    assert all(sum(len(x) for x, _ in row) <= 64 for row in rows)
    assert sorted(t for row in rows for x, _ in row for t in x) == sorted(t for x, _ in docs for t in x)
    assert len(rows) == 5  # best fit: 64 | 64 | 50+7+7 | 36+3 | 30 would need 5 rows of 64
    b = collate(rows, 0)
    for r, row in enumerate(rows):
        at = 0
        for x, _ in row:
            assert b["position_ids"][r, at:at + len(x)].tolist() == list(range(len(x)))
            assert b["loss_mask"][r, at] == 0  # no loss on predicting a document's first token from another
            at += len(x)
        assert b["loss_mask"][r, at:].sum() == 0  # padding


def test_packed_sdpa_gives_sdpa_loss_and_gradients(monkeypatch):
    """packed_sdpa (documents cut out of the rows, grouped by length) computes what sdpa's block-diagonal mask
    does: the same loss and gradients, with grouped-query heads, a row of one document and right padding."""
    monkeypatch.setattr(packed_attention, "MIN_LEN", 8)
    rng = random.Random(3)
    batch = collate(pack([doc(rng, n) for n in [20, 33, 11, 60, 64, 5, 1, 40, 17]], 64), 0)
    assert batch["input_ids"].shape[1] == 64 and len(batch["input_ids"]) >= 4
    results = []
    for attn in ("sdpa", "packed_sdpa"):
        model = tiny_llama(attn, kv_heads=2).train()
        loss = masked_lm_loss(model, batch)
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-4)
    _, src, dst = packed_attention.document_plan(batch["position_ids"], len(batch["input_ids"]))
    assert torch.equal(src[dst], torch.arange(batch["input_ids"].numel()))  # every token, once, from its own slot


def test_packed_sdpa_below_its_length_or_with_a_padding_mask_is_sdpa():
    """Short rows, generation with a padding mask and a cache: transformers' sdpa (the prefill bit for bit,
    the decoding steps through decode_attention: the same tokens, scores to float rounding)."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    outs, prefill = [], []
    for attn in ("sdpa", "packed_sdpa"):
        model = tiny_llama(attn, kv_heads=2).eval()
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                       pad_token_id=0, output_scores=True, return_dict_in_generate=True))
            prefill.append(model(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(prefill[0], prefill[1])
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("queries", [1, 3])
def test_decode_attention_is_sdpa_over_a_cache(queries):
    """A few queries against a longer cache (a decoding step; a speculative verification), grouped-query heads, a
    boolean mask with padding: decode_attention computes sdpa's output; a query with every key masked gets no NaN."""
    torch.manual_seed(1)
    B, H, Hkv, S, D = 3, 4, 2, 9, 8
    q, k, v = torch.randn(B, H, queries, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    mask = torch.ones(B, 1, queries, S, dtype=torch.bool).tril(S - queries)
    mask[1, :, :, :4] = False  # a left-padded row
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(packed_attention.decode_attention(q, k, v, mask, None), ref)
    mask[2] = False
    assert not packed_attention.decode_attention(q, k, v, mask, None).isnan().any()


def test_packed_sdpa_keeps_a_sliding_window(monkeypatch):
    """A sliding-window model (its window lives in the mask) runs sdpa with its mask, even on long packed rows."""
    from transformers import MistralConfig, MistralForCausalLM
    monkeypatch.setattr(packed_attention, "MIN_LEN", 8)
    batch = collate(pack([doc(random.Random(4), n) for n in [30, 20, 14]], 64), 0)
    logits = []
    for attn in ("sdpa", "packed_sdpa"):
        torch.manual_seed(0)
        cfg = MistralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, sliding_window=4)
        model = attention.use(MistralForCausalLM(cfg), attn).eval()
        with torch.no_grad():
            logits.append(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits)
    assert torch.equal(logits[0], logits[1])


def test_activation_checkpointing_gives_the_same_gradients():
    rng = random.Random(2)
    batch = collate(pack([doc(rng, n) for n in [20, 33, 11, 60]], 64), 0)
    grads = []
    for ckpt in (False, True):
        model = tiny_llama().train()
        if ckpt:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        masked_lm_loss(model, batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_attention_implementation_is_chosen_by_config():
    """The seam sparse attention plugs into: a registered implementation is what the model calls."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    attention.register("counting_sdpa", counting)
    model = tiny_llama("counting_sdpa")
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert len(calls) == 2  # one per layer
    with pytest.raises(ValueError, match="unknown attention implementation 'nope'.*dsa.*sdpa"):
        attention.use(model, "nope")
    with pytest.raises(ValueError, match="needs lightning indexers"):
        attention.use(model, "dsa")


def test_ladder_config():
    real = load_config("real")
    assert [s.seq_len for s in real.ramp.stages] == [4096, 32768, 131072, 200000]
    # the long rungs split each sequence over context-parallel ranks of the megatron engine
    assert real.runtime.train_engine == "megatron" and [real.ramp_ranks(s) for s in real.ramp.stages] == [1, 1, 4, 4]
    with pytest.raises(ConfigError, match=r"ramp.stages.2.cp: context parallelism needs a train engine that splits "
                                          r"sequences over ranks \(megatron;"):
        load_config("real", ["runtime.train_engine=torch"])
    assert all(a.rope_theta < b.rope_theta for a, b in zip(real.ramp.stages, real.ramp.stages[1:]))
    assert all(a.long_share <= b.long_share for a, b in zip(real.ramp.stages, real.ramp.stages[1:]))
    tiny = load_config("tiny-dense")  # its first stage has the most long rows: retrieval must form there
    assert tiny.eval_lengths() == [128, 256, 512, 1024]
    with pytest.raises(ConfigError, match="strictly increasing seq_len"):
        load_config("tiny", ["ramp.stages=[{seq_len: 512, tokens: 100000, rope_theta: 1.0e4}, "
                             "{seq_len: 256, tokens: 100000, rope_theta: 2.0e4}]"])
    with pytest.raises(ConfigError, match="less than one step"):
        load_config("tiny", ["ramp.stages=[{seq_len: 512, tokens: 100, rope_theta: 1.0e4}]"])


def test_stage_checkpoints_carry_their_rope_settings(tmp_path):
    """What serving engines read: each stage's config.json has its RoPE base/scaling and length."""
    from posttrain.config import RampStage
    from posttrain.stages.ramp import with_rope
    stage = RampStage(seq_len=256, tokens=10**6, rope_theta=40000.0,
                      rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})
    with_rope(tiny_llama(), stage).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["max_position_embeddings"] == 256
    rope = saved.get("rope_parameters") or saved.get("rope_scaling")
    assert rope["rope_theta"] == 40000.0 and rope["rope_type"] == "yarn" and rope["factor"] == 2.0


def test_a_rung_stops_once_retrieval_formed_and_not_before(tok):
    """`until_long_context`: the rung asks, every `check_every` steps, whether long_context at its length on validation
    tasks reached the bar, and stops there (its steps and tokens say so); a bar no model reaches runs the budget."""
    from posttrain.config import ModelConfig, RampStage
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.models.preset import build_model
    from posttrain.stages.ramp import retrieval_formed
    from posttrain.train import train
    cfg = load_config("smoke-dense")
    asked = []

    def run(bar: float) -> dict:
        torch.manual_seed(0)
        model = build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                                        max_position_embeddings=64), tok)
        st = RampStage(seq_len=64, tokens=10**6, rope_theta=1e4, until_long_context=bar, check_every=2)
        stop = retrieval_formed(cfg, st, tok)
        ids = torch.randint(3, len(tok), (2, 16))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(2, 16)}
        return train(TorchTrainEngine.for_lm(model, lr=1e-3), lambda i: batch, steps=5, lr=1e-3, warmup=1,
                     stop_fn=lambda e: asked.append(1) or stop["stop_fn"](e), stop_every=stop["stop_every"])
    assert run(0.0)["stopped_at"] == [2] and len(asked) == 1  # 0: formed at the first check
    hist = run(1.0)  # an untrained model retrieves nothing: the whole budget, checked at steps 2 and 4
    assert "stopped_at" not in hist and len(hist["loss"]) == 5 and len(asked) == 3
    assert retrieval_formed(cfg, RampStage(seq_len=64, tokens=10**6, rope_theta=1e4), tok) == {}


def test_long_documents_spread_their_code_lengths(tok):
    """ramp.long_code_digits: the training documents' codes take every length from min to max, evenly; evaluation's
    tasks keep the environment's four digits."""
    import re
    from collections import Counter

    from environments import long_context
    from posttrain.stages.ramp import long_documents, prose_lens
    cfg = load_config("smoke-dense", ["ramp.long_code_digits=[4,6]"])
    docs = long_documents(tok, 128, 30, 0, 8.0, cfg.ramp.long_code_digits)
    codes = [re.search(r"Answer: (\d+)", tok.decode(ids)).group(1) for ids, _ in docs]
    per_length = Counter(map(len, codes))  # (documents that do not fit the shortest lengths are dropped, evenly)
    assert set(per_length) == {4, 5, 6} and len(set(per_length.values())) == 1
    assert {len(t.answer) for t in long_context.fit_to_length("test", 8, 0, 128, lambda ts: prose_lens(tok, ts))} == {4}
    with pytest.raises(ConfigError, match="long_code_digits"):
        load_config("smoke-dense", ["ramp.long_code_digits=[6,4]"])
    assert long_documents(tok, 128, 4, 0) == []  # fewer than one a length: none (ramp.long_docs below 5)
