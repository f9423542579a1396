"""The draft (MTP) layer through the megatron train engine: sft's loop trains it as the torch engine does (the same
losses, MTP losses and accuracies, weights and, on GLM-5, the draft router's expert balancing), over two gloo ranks as
on one, and it resumes from Megatron's distributed checkpoint."""
import random
import warnings

import pytest
import torch

from posttrain.config import MoEConfig, ModelConfig
from posttrain.models import mtp
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
from tests.test_glm5_model import GLM5
from tests.test_megatron import (STEP_TOKENS, Updates, _free_port, _lm_batches, _rank, _sharded_rank, _steps,
                                  loss_tol, threads)
from tests.test_megatron import _steady_adam  # noqa: F401  (autouse: the compared AdamWs at ADAM_EPS here too)

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
MOE = MoEConfig(bias_update_rate=0.01)
AUX = MoEConfig(bias_update_rate=0.01, aux_loss_weight=0.1)  # the draft's router has its share of the balance loss


@pytest.fixture(scope="module", autouse=True)
def _process_groups(megatron_groups):
    """The engine opens a world of one in this process; later tests open their own (conftest)."""


@pytest.fixture(scope="module")
def drafts(tok, tmp_path_factory):
    """The tiny Llama preset and a two-layer GLM-5 (its draft layer routed: GLM-5's own, stored as layer 2), each
    with a new draft layer of two steps."""
    torch.manual_seed(0)
    shapes = {"llama": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
              "glm5": {**GLM5, "num_layers": 2, "num_heads": 4, "qk_rope_head_dim": 4,
                       "indexer_types": ["full", "shared"]}}
    out = {}
    for name, shape in shapes.items():
        model = mtp.install(build_model(ModelConfig(**{**shape, "max_position_embeddings": 256}), tok), 2)
        out[name] = str(tmp_path_factory.mktemp(name))
        save_checkpoint(model, tok, out[name])
    return out


@pytest.mark.parametrize("arch,moe", [("llama", MOE), ("glm5", MOE), ("glm5", AUX)], ids=["llama", "glm5", "glm5-aux"])
def test_sft_trains_the_draft_layer_as_the_torch_engine(drafts, tok, arch, moe):
    """posttrain.train's loop over packed and padded conversations, the MTP loss at weight 0.3 beside the LM loss:
    the torch engine's losses, MTP losses and first-step accuracies, and weights (the draft layer's included), and on
    GLM-5 the draft router's load figures, bias moves and terms of the balance loss."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.train import flat_examples, pad_examples, train
    rng = random.Random(0)
    data = [([rng.randrange(3, len(tok)) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2))
            for n in (rng.randrange(6, 20) for _ in range(6))]
    batches = [(flat_examples if i % 2 else pad_examples)(rng.sample(data, 3), tok.pad_token_id, 64) for i in range(6)]
    kw = dict(steps=6, lr=1e-2, warmup=1, desc="sft")
    model, _ = load_checkpoint(drafts[arch])
    start = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp.")}
    with threads(1):  # the torch engine at one thread, megatron at two: their reductions block otherwise
        want = train(TorchTrainEngine.for_lm(model, lr=1.0, mtp_weight=0.3, moe=moe), lambda i: batches[i], **kw)
    curves = want
    engine = MegatronTrainEngine(drafts[arch], lr=1.0, mtp_weight=0.3, moe=moe)
    updates = Updates(engine)
    with threads(2):
        got = train(engine, lambda i: batches[i], **kw)
    assert curves["mtp_loss"][-1] < curves["mtp_loss"][0] - 0.3  # the draft learned (6.0 -> 4.9 / 5.6 measured)
    # each a mean over the batch's positions (the balance loss's terms too); leaving the draft's balance terms out
    # parts the losses by 3e-3 to 1e-2
    tokens = max(b["input_ids"].numel() for b in batches)
    config = model.config
    assert max(abs(a - b) for a, b in zip(want["loss"], got["loss"])) < loss_tol(want["loss"], tokens, config)
    assert max(abs(a - b) for a, b in zip(curves["mtp_loss"], got["mtp_loss"])) < \
        loss_tol(curves["mtp_loss"], tokens, config)
    assert max(abs(a - b) for a, b in zip(curves["mtp_acc1"], got["mtp_acc1"])) <= \
        loss_tol(curves["mtp_acc1"], tokens, config)
    assert ("moe_aux_loss" in got) == bool(moe.aux_loss_weight)
    for key in [k for k in want if k.startswith("moe_")]:  # the draft's router is the last one (moe_cv_1)
        assert max(abs(a - b) for a, b in zip(want[key], got[key])) <= loss_tol(want[key], tokens, config), key
    assert ("moe_cv_1" in got) == (arch == "glm5")
    moved, own = engine.weights(), model.state_dict()
    # a wrong or missing gradient moves them by ~lr (1e-2)
    assert set(moved) == set(own) and max((moved[k] - own[k]).abs().max().item() for k in own) < updates.tol(tokens)
    # every draft tensor trained but GLM-5's indexer (it learns from the ramp's indexer loss only)
    assert {k for k, v in start.items() if torch.equal(moved[k], v)} == {k for k in start if ".indexer." in k}


@pytest.mark.parametrize("arch,par", [("llama", {"cp": 2}), ("llama", {"tp": 2}), ("glm5", {"ep": 2}),
                                      ("glm5", {"cp": 2, "moe": AUX}), ("llama", {"pp": 2}),
                                      ("glm5", {"pp": 2, "micro_batches": 2, "moe": AUX})],
                         ids=["cp2", "tp2", "glm5-ep2", "glm5-cp2-aux", "pp2-tied", "glm5-pp2-1f1b-aux"])
def test_two_gloo_ranks_train_the_draft_layer_as_one_rank(drafts, tmp_path, gloo_pair, arch, par):
    """cp2: each rank runs the draft layer over the whole sequence, its gradient (and the embedding's and head's for
    it) a share; tp2: the draft reads the vocabulary-parallel embedding and head; ep2: two replicas, the draft's
    experts whole on each, its router's load summed over both; with the balance loss the draft's terms (the whole
    value on each context-parallel rank) count once. pp2: the draft on the last stage reads the embedding through
    the tied output layer, or (GLM-5, untied) through a copy of the first stage's, whose gradients the two stages
    sum; in two micro-batches in the 1F1B order each adds its share of the batch's draft and balance losses."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    path, out = drafts[arch], str(tmp_path / "rank0.pt")
    par = {"moe": MOE, **par, "mtp_weight": 0.3}
    gloo_pair.spawn(_rank, (2, _free_port(), par, path, out, True, 2048))
    got = torch.load(out)
    one = MegatronTrainEngine(path, lr=1e-3, mtp_weight=0.3, moe=par["moe"])
    updates = Updates(one)
    with threads(2):  # the ranks run at one thread each
        want = [x.item() for x in _steps(one, [], lm=True)]
    assert max(abs(a - b) for a, b in zip(want, got["losses"])) < loss_tol(want, STEP_TOKENS, one.hf_config)
    # the last step's figures: means over the step's positions, after four steps' drift
    assert set(one.mtp_stats) == set(got["mtp"]) and all(
        abs(one.mtp_stats[k] - got["mtp"][k]) <= loss_tol([one.mtp_stats[k]] * 4, STEP_TOKENS, one.hf_config)
        for k in got["mtp"])
    assert set(one.moe_stats) == set(got["moe"]) and all(
        abs(one.moe_stats[k] - got["moe"][k]) <= loss_tol([one.moe_stats[k]] * 4, STEP_TOKENS, one.hf_config)
        for k in got["moe"])
    w = one.weights()
    assert set(w) == set(got["weights"]) and \
        max((w[k] - got["weights"][k]).abs().max().item() for k in w) < updates.tol(STEP_TOKENS)
    assert any(k.startswith("mtp.") for k in w)


def test_the_draft_layer_resumes_from_a_distributed_checkpoint(drafts, tmp_path):
    """Saved after two steps (the draft's weights and AdamW moments with the model's), a new engine continues as the
    first did."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    batches = _lm_batches(load_checkpoint(drafts["glm5"])[0].config.vocab_size)

    def steps(engine, n):
        out = []
        for i in range(n):
            out.append(engine.forward_backward(batches[i % 2]).item())
            engine.step(1.0)
        return out
    first = MegatronTrainEngine(drafts["glm5"], lr=1e-3, mtp_weight=0.3, moe=MOE)
    first.train()
    steps(first, 2)
    first.save_sharded(tmp_path / "dist")
    want = steps(first, 2)
    second = MegatronTrainEngine(drafts["glm5"], lr=1e-3, mtp_weight=0.3, moe=MOE)
    second.train()
    second.load_sharded(tmp_path / "dist")
    assert steps(second, 2) == pytest.approx(want, abs=1e-6)
    a, b = first.weights(), second.weights()
    assert max((a[k] - b[k]).abs().max().item() for k in a if k.startswith("mtp.")) < 1e-6


def test_micro_batches_train_the_draft_layer_as_the_whole_batch(drafts):
    """sft's batch in two micro-batches (`megatron.micro_batches`, the 1F1B split): each adds its share of the
    whole batch's draft loss and balance loss, so the losses, figures and weights are one forward's."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    runs, updates = [], None
    for micro in (1, 2):  # at one thread and at two: their reductions block otherwise
        engine = MegatronTrainEngine(drafts["glm5"], lr=1e-3, mtp_weight=0.3, moe=AUX, micro_batches=micro)
        updates = updates or Updates(engine)
        with threads(micro):
            losses = [x.item() for x in _steps(engine, [], lm=True)]
        runs.append((losses, engine.mtp_stats, engine.moe_stats, engine.weights()))
    (losses, mtp_stats, moe_stats, w), (losses2, mtp_stats2, moe_stats2, w2) = runs
    assert max(abs(a - b) for a, b in zip(losses, losses2)) < loss_tol(losses, STEP_TOKENS, engine.hf_config)
    # the last step's figures: means over the step's positions, after four steps' drift
    assert set(mtp_stats) == {"mtp_loss", "mtp_acc1"} and all(
        abs(mtp_stats[k] - mtp_stats2[k]) <= loss_tol([mtp_stats[k]] * 4, STEP_TOKENS, engine.hf_config)
        for k in mtp_stats)
    assert "moe_aux_loss" in moe_stats and all(
        abs(moe_stats[k] - moe_stats2[k]) <= loss_tol([moe_stats[k]] * 4, STEP_TOKENS, engine.hf_config)
        for k in moe_stats)
    assert max((w[k] - w2[k]).abs().max().item() for k in w) < updates.tol(STEP_TOKENS)


def test_a_pipeline_checkpoint_with_a_draft_layer_resumes_on_one_rank(drafts, tmp_path, gloo_pair):
    """Saved over two pipeline stages (the draft layer and the embedding's copy on the last, its moments a replica of
    the first stage's), one rank trains on from it as the two did."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    folder, out = tmp_path / "dist", str(tmp_path / "losses.pt")
    gloo_pair.spawn(_sharded_rank, (2, _free_port(), drafts["glm5"], str(folder), out,
                                    {"pp": 2, "mtp_weight": 0.3, "moe": MOE}))
    one = MegatronTrainEngine(drafts["glm5"], lr=1e-3, mtp_weight=0.3, moe=MOE)
    one.load_sharded(folder)
    with threads(2):  # the ranks ran at one thread each
        got = [x.item() for x in _steps(one, [], lm=True)]
    want = torch.load(out)
    assert max(abs(a - b) for a, b in zip(got, want)) < loss_tol(want * 2, STEP_TOKENS, one.hf_config)  # steps 5-8
