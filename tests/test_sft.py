"""sft packing: whole conversations packed into rows, the loss unchanged by who shares the row."""
import torch

import environments
from posttrain.config import load_config
from posttrain.sft import _batches, build_examples
from posttrain.train import masked_lm_loss, pad_examples
from tests.test_ramp import tiny_llama


def test_packed_sft_batches_give_the_same_loss_as_each_conversation_alone(tok):
    cfg = load_config("smoke", ["sft.packing=true", "sft.batch_size=2", "sft.seq_len=256"])
    tasks = [t for d in environments.DOMAINS for t in environments.get(d).generate("train", 4, 0)]
    examples = build_examples(cfg, tok, tasks, 0)
    batch = _batches(cfg, tok, examples)(0)
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
