import torch

from posttrain.opd import reverse_kl
from posttrain.rl import clipped_pg_loss, group_advantages


def test_group_advantages_are_normalised_within_groups():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)
    assert torch.allclose(adv[:4].mean(), torch.tensor(0.0), atol=1e-6) and adv[0] > 0 > adv[1]
    assert torch.all(adv[4:] == 0)  # a group with one outcome carries no signal


def test_policy_gradient_raises_logprob_of_rewarded_tokens():
    logits = torch.zeros(1, 3, 5, requires_grad=True)
    batch = {"input_ids": torch.tensor([[0, 2, 3, 1]]), "mask": torch.ones(1, 3),
             "old_logprobs": torch.full((1, 3), -torch.log(torch.tensor(5.0)))}
    loss, stats = clipped_pg_loss(logits, batch, torch.tensor([1.0]), 0.2)
    loss.backward()
    assert logits.grad[0, 0, 2] < 0 and abs(stats["ratio_mean"] - 1) < 1e-5  # descent raises token 2


def test_reverse_kl_is_zero_for_identical_and_positive_otherwise():
    s = torch.randn(2, 4, 7)
    mask = torch.ones(2, 4)
    assert reverse_kl(s, s.clone(), mask).abs() < 1e-6
    assert reverse_kl(s, torch.randn(2, 4, 7), mask) > 0
