"""A batch with nothing to score (rows of prompt only, an empty row: bench/sft's packed variant at the tiny profile's
1024 tokens) costs nothing and raises nothing: `sequence_logprobs` returns an empty tensor without running the model
on every path (one row, batched, fused), and the masked LM loss over it is 0 and backpropagates."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.models import head, mtp
from posttrain.engines.lm import masked_lm_loss


@pytest.fixture
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def counting_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("shape", [(1, 12), (3, 12), (1, 0), (1, 1)],
                         ids=["one row", "batched", "empty row", "one token"])
def test_nothing_scored_returns_empty_without_running_the_model(model, monkeypatch, fused, shape):
    monkeypatch.setenv(head.ENV, fused)
    assert head.fused(model) == (fused == "1")
    calls = counting_forwards(model)
    ids = torch.randint(0, 64, shape)
    mask = torch.zeros(shape)
    mask[:, :1] = 1  # the first position is never a target (no token before it)
    out = head.sequence_logprobs(model, ids, mask)
    assert out.shape == (0,) and out.dtype == torch.float32 and out.device.type == "cpu"
    assert calls == []


@pytest.mark.parametrize("shape", [(1, 12), (3, 12), (1, 0)], ids=["one row", "batched", "empty row"])
def test_masked_lm_loss_over_nothing_is_zero_and_backpropagates_nothing(model, shape):
    batch = {"input_ids": torch.randint(0, 64, shape), "loss_mask": torch.zeros(shape, dtype=torch.long)}
    loss = masked_lm_loss(model, batch)
    assert loss.item() == 0.0 and torch.isfinite(loss)
    loss.backward()  # raises nothing
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert masked_lm_loss(model, batch).item() == 0.0


def test_an_empty_micro_batch_leaves_the_others_gradient_as_it_was(model):
    ids = torch.randint(0, 64, (1, 12))
    masked_lm_loss(model, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}).backward()
    before = [p.grad.clone() for p in model.parameters()]
    masked_lm_loss(model, {"input_ids": ids, "loss_mask": torch.zeros_like(ids)}).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_scored_rows_still_score_the_same_on_one_row_and_batched(model):
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.zeros_like(ids)
    mask[0, 5:] = 1  # the second row has nothing to score: batched, it adds nothing
    both = head.sequence_logprobs(model, ids, mask)
    alone = head.sequence_logprobs(model, ids[:1], mask[:1])
    assert both.shape == (7,) and torch.allclose(both, alone, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 12), (1, 0)], ids=["prompt only", "empty row"])
def test_mtp_loss_over_nothing_raises_nothing(model, shape):
    m = mtp.install(model, 2)
    batch = {"input_ids": torch.randint(0, 64, shape), "loss_mask": torch.zeros(shape, dtype=torch.long)}
    curves: dict = {}
    loss = mtp.with_loss(masked_lm_loss, 0.5, curves)(m, batch)
    assert loss.item() == 0.0
    loss.backward()


@pytest.mark.parametrize("shape", [(2, 12), (1, 0)], ids=["prompt only", "empty row"])
def test_under_ddp_nothing_scored_still_joins_the_gradient_all_reduce(model, shape, tmp_path):
    """Every DDP rank must run its forward and backward (the other ranks wait in the all-reduce): this one runs
    the model on one kept position and adds zero gradients."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    try:
        batch = {"input_ids": torch.randint(0, 64, shape), "loss_mask": torch.zeros(shape, dtype=torch.long)}
        loss = masked_lm_loss(ddp, batch)
        assert loss.item() == 0.0
        loss.backward()
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    finally:
        # the reducer before its process group: freed after it, gloo's destructor hung joining its threads (seen
        # once, after another test's process group in the same process)
        del ddp
        dist.destroy_process_group()
