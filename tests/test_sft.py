"""sft packing: whole conversations packed into rows, the loss unchanged by who shares the row."""
import torch

import environments
from posttrain.config import load_config
from posttrain.packing import collate
from posttrain.stages.sft import _batches, build_examples
from posttrain.train import pad_examples
from posttrain.engines.lm import masked_lm_loss
from tests.test_ramp import tiny_llama


def test_packed_sft_batches_give_the_same_loss_as_each_conversation_alone(tok):
    cfg = load_config("smoke-dense", ["sft.packing=true", "sft.batch_size=2", "sft.seq_len=256"])
    tasks = [t for d in environments.DOMAINS for t in environments.get(d).generate("train", 4, 0)]
    examples = build_examples(cfg, tok, tasks, 0)
    batch = collate(_batches(cfg, examples)(0), tok.pad_token_id)
    T = batch["input_ids"].shape[1]
    assert batch["input_ids"].shape[0] == 2 and T <= 256 and "position_ids" in batch

    model = tiny_llama().eval()
    model.resize_token_embeddings(len(tok))
    # the conversations in the batch, recovered from the position restarts
    total, weight = 0.0, 0.0
    for r in range(2):
        starts = (batch["position_ids"][r] == 0).nonzero().flatten().tolist() + [T]
        for a, b in zip(starts, starts[1:]):
            ids, mask = batch["input_ids"][r, a:b].tolist(), batch["loss_mask"][r, a:b].tolist()
            if sum(mask) == 0:
                continue  # padding
            assert (ids, [int(m) for m in mask]) in [(x, [0] + m[1:]) for x, m in examples]
            alone = pad_examples([(ids, mask)], tok.pad_token_id, 256)
            with torch.no_grad():
                total += masked_lm_loss(model, alone).item() * sum(mask)
            weight += sum(mask)
    with torch.no_grad():
        packed = masked_lm_loss(model, batch).item()
    assert abs(packed - total / weight) < 1e-4


def test_padding_free_batches_give_the_padded_loss_and_gradients_mtp_included():
    """SFT's padding-free batches (one row of conversations, positions restarting, varlen_sdpa) train exactly
    what padded batches do: the same loss, the same MTP loss and the same gradients."""
    import random

    from transformers import MistralConfig, MistralForCausalLM

    from posttrain.models import attention, mtp
    from posttrain.stages.sft import collator
    rng = random.Random(0)
    # conversation-like: untrained prompt tokens, then the trained answer
    examples = [([rng.randrange(1, 64) for _ in range(n)], [0] * 2 + [1] * (n - 2)) for n in (9, 30, 17, 25, 12)]
    padded_model, flat_model = (mtp.install(tiny_llama("sdpa", kv_heads=2), 2).train() for _ in range(2))

    class Tok:
        pad_token_id = 0
    results = []
    for model, batch in ((padded_model, pad_examples(examples, 0, 28)),  # 30 tokens: truncated alike on both paths
                         (flat_model, collator(Tok(), flat_model, 28)(examples))):
        curves: dict = {}
        loss = mtp.with_loss(masked_lm_loss, 1.0, curves)(model, batch)
        loss.backward()
        results.append((batch, loss.detach(), curves["mtp_loss"][0],
                        torch.cat([p.grad.flatten() for p in model.parameters()])))
    (padded, *a), (flat, *b) = results
    assert padded["input_ids"].shape == (5, 28) and flat["input_ids"].shape == (1, 9 + 28 + 17 + 25 + 12)
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-5)
    assert abs(a[1] - b[1]) < 1e-5
    torch.testing.assert_close(a[2], b[2], atol=1e-6, rtol=1e-4)
    assert flat_model.config._attn_implementation == mtp.get(flat_model).config._attn_implementation == "varlen_sdpa"
    # sft.packing's rows go in as the same one row
    packed = collator(Tok(), flat_model, 28, packing=True)([examples[:2], examples[2:]])
    assert all(torch.equal(packed[k], flat[k]) for k in flat)
    # eager and sliding-window models keep padded batches
    windowed = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                                sliding_window=4))
    assert not attention.padding_free(tiny_llama("eager")) and not attention.padding_free(windowed)
    assert windowed.config._attn_implementation == "sdpa"
