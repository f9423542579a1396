"""The kernels' torch fallbacks against their plain-torch references, and the fused head path giving the training
losses what the full logits give them (the Triton code itself, interpreted on CPU:
tests/slow/test_triton_interpreted.py)."""
from types import SimpleNamespace

import pytest
import torch

from kernels import selfcheck
from posttrain.models import head
from posttrain.config import ModelConfig
from posttrain.models.preset import build_model
from posttrain.engines.lm import masked_lm_loss

TOL = 1e-3  # fp32 against fp32 references at |values| of a few units: errors are ~1e-5


def test_the_torch_fallbacks_match_the_references():
    errors = selfcheck.check("cpu")
    assert errors.pop("triton") == 0.0
    assert max(errors.values()) < TOL, errors


@pytest.fixture
def model(tok):
    torch.manual_seed(0)
    return build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                   max_position_embeddings=128), tok)


def _both(monkeypatch, fn):
    """fn() on the full-logit path and on the fused path: (results, gradients) of each."""
    out = []
    for forced in ("0", "1"):
        monkeypatch.setenv(head.ENV, forced)
        out.append(fn())
    return out


def _grads(model, value):
    model.zero_grad()
    value.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_fused_head_gives_the_lm_loss_and_its_gradient(model, monkeypatch):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    mask = (torch.rand(3, 12, generator=g) > 0.4).float()
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}

    def run():
        loss = masked_lm_loss(model, batch)
        return loss.item(), _grads(model, loss)
    (full, g_full), (fused, g_fused) = _both(monkeypatch, run)
    assert fused == pytest.approx(full, abs=TOL) and (g_full - g_fused).abs().max() < TOL


def _samples(vocab, lens=(5, 3, 7)):
    g = torch.Generator().manual_seed(2)
    return [SimpleNamespace(prompt_ids=torch.randint(0, vocab, (4,), generator=g).tolist(),
                            ids=torch.randint(0, vocab, (n,), generator=g).tolist(), gen_mask=[1] * (n - 1) + [0])
            for n in lens]


def test_fused_head_gives_the_policy_logprobs_entropy_and_reverse_kl(model, monkeypatch):
    vocab = model.config.vocab_size
    samples = _samples(vocab)
    teacher = [torch.log_softmax(torch.randn(sum(s.gen_mask), vocab), -1) for s in samples]

    def run():
        logp, ent = head.completion_scores(model, samples, 0, temperature=0.8)
        kl_sum, kl = head.completion_reverse_kl_loss(model, samples, 0, teacher, 0.8, torch.ones(len(samples), 7))
        return logp.detach(), ent.detach(), kl, _grads(model, logp.sum() + ent.sum() + kl_sum)
    full, fused = _both(monkeypatch, run)
    for a, b in zip(full, fused):
        assert a.shape == b.shape and (a - b).abs().max() < TOL
    assert (full[0][1, 3:] == 0).all() and (fused[2][1, 2:] == 0).all()  # 0 past the end / off generated


def test_fused_head_gives_the_reverse_kl_loss_with_its_gradient_made_in_the_forward(model, monkeypatch):
    vocab = model.config.vocab_size
    samples = _samples(vocab)
    teacher = [torch.log_softmax(torch.randn(sum(s.gen_mask), vocab), -1) for s in samples]
    weights = torch.rand(len(samples), max(len(s.ids) for s in samples), generator=torch.Generator().manual_seed(3))

    def run():
        loss, kl = head.completion_reverse_kl_loss(model, samples, 0, teacher, 0.8, weights)
        assert not kl.requires_grad
        return loss.detach(), kl, _grads(model, loss * 2)  # scaled after the fact, as a weighted OPD step does
    full, fused = _both(monkeypatch, run)
    for a, b in zip(full, fused):
        assert a.shape == b.shape and (a - b).abs().max() < TOL


def test_a_head_that_is_not_hidden_times_embeddings_is_refused_on_the_fused_path(model, monkeypatch):
    monkeypatch.setenv(head.ENV, "1")
    biased = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.normal_(biased.bias)
    model.config.tie_word_embeddings = False
    model.lm_head = biased
    with pytest.raises(ValueError, match="bias=True"):
        head.completion_scores(model, _samples(model.config.vocab_size), 0, temperature=1.0)


def test_fused_is_the_default_on_large_vocabularies_only(model, monkeypatch):
    monkeypatch.delenv(head.ENV, raising=False)
    assert model.config.vocab_size < head.FUSED_MIN_VOCAB and not head.fused(model)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, head.FUSED_MIN_VOCAB, bias=False)
    assert head.fused(model)
