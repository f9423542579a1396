"""GLM-5 (GlmMoeDsaForCausalLM) through the megatron-core train engine: latent attention and routed experts in
Megatron's own modules give transformers' logits and the torch engine's updates and expert balancing; expert and
pipeline parallelism over two gloo processes equal one rank; what Megatron cannot compute the same way fails first."""
import json
import math
import shutil
import warnings

import pytest
import torch

from posttrain.config import MoEConfig, ModelConfig
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
from tests.test_glm5_model import GLM5
from tests.test_megatron import (STEP_TOKENS, Updates, _free_port, _rank, _samples, _sharded_rank, _steps, _tokens,
                                  equals_transformers, forward_tol, loss_tol, sum_tol, threads)
from tests.test_megatron import _steady_adam  # noqa: F401  (autouse: the compared AdamWs at ADAM_EPS here too)

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="module", autouse=True)
def _process_groups(megatron_groups):
    """The engine opens a world of one in this process; later tests open their own (conftest)."""


def indexer_tol(stat: str, values, keys: int, queries: int) -> float:
    """The DSA indexer's figures, means over `queries` scored queries of up to `keys` keys each, after len(values)
    steps (`loss_tol`'s drift). The top-k recall sums attention probabilities (its partial sums within 1 once divided
    by the queries). The KL sums t (log t - log q): ~1e-5, a small difference of terms ~1, so each term's own
    rounding, at most t |log t| + t |log q| <= 2 / e + KL, counts, not the partial sums'."""
    if stat == "topk_recall":
        return math.sqrt(len(values)) * sum_tol(1.0, keys * queries)
    return math.sqrt(len(values)) * sum_tol(2 / math.e + max(values), keys * queries) / queries


@pytest.fixture(scope="module")
def glm5(tok, tmp_path_factory):
    """Two layers (dense, then eight routed experts and a shared one; a full indexer, then a shared one), its norms
    and expert bias moved off their initial values so that each is read."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**GLM5, "num_layers": 2, "num_heads": 4, "qk_rope_head_dim": 4,
                                       "indexer_types": ["full", "shared"], "max_position_embeddings": 256}), tok)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    path = tmp_path_factory.mktemp("glm5")
    save_checkpoint(model, tok, path)
    return str(path)


@pytest.fixture(scope="module")
def adopted(glm5, tmp_path_factory):
    """The same weights with DSA adopted: each indexer keeps 4 keys (the samples' rows have 9-14 tokens)."""
    path = tmp_path_factory.mktemp("adopted")
    shutil.copytree(glm5, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "index_topk": 4}))
    return str(path)


def test_logits_equal_transformers_and_weights_round_trip_exactly(glm5):
    """The indexers and the expert bias included in the export."""
    own = equals_transformers(glm5)
    assert any(".indexer." in k for k in own) and any("e_score_correction_bias" in k for k in own)


def test_a_checkpoint_that_adopted_dsa_attends_sparsely_as_transformers(glm5, adopted):
    """The indexer of layer 0 selects 4 keys for both layers (layer 1 shares its selection): transformers' logits, not
    the dense ones."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    equals_transformers(adopted)
    samples = _samples(load_checkpoint(glm5)[0].config.vocab_size)
    with torch.no_grad():
        dense, sparse = (MegatronTrainEngine(p, "reference").forward(samples) for p in (glm5, adopted))
    assert (dense - sparse).abs().max().item() > 1e-2


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
def test_the_ramps_dsa_adoption_trains_the_indexers_as_the_torch_engines(adopted, mode):
    """Three steps of the ramp's adoption: the warm-up (only the indexers train, toward the dense attention) and
    sparse training (the LM loss, and each indexer toward its selected keys' attention, weighted by kl_weight), as
    `posttrain.stages.ramp` runs them through the torch engine: the same indexer KL, recall, losses and weights."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.models import dsa, glm5 as arch
    from posttrain.train import train
    torch.manual_seed(0)
    model, _ = load_checkpoint(adopted)
    batches = [torch.randint(3, model.config.vocab_size, (2, 12)) for _ in range(3)]

    def next_batch(i):
        return {"input_ids": batches[i % 3], "loss_mask": torch.ones_like(batches[i % 3])}
    arch.install_dsa(model, 4, kl_queries=8)
    dsa.state(model).collect = True
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with threads(1):
        job = dict(indexers=(mode, 8, 1.0)) if mode == "warmup" else dict(dsa_weight=0.5)
        torch_engine = TorchTrainEngine.for_lm(model, lr=1e-2, **job)  # the ramp's job through the torch engine
        want = train(torch_engine, next_batch, steps=3, lr=1e-2, warmup=1)
        torch_engine.close()
    engine = MegatronTrainEngine(adopted, lr=1e-2, train_indexers=(mode, 8, 1.0 if mode == "warmup" else 0.5),
                                 recompute=mode == "sparse")  # the ramp recomputes with activation_checkpointing
    updates = Updates(engine)
    with threads(2):  # the torch engine ran at one thread
        got = train(engine, next_batch, steps=3, lr=1e-2, warmup=1)
    tokens = batches[0].numel()
    for key in ("indexer_kl", "topk_recall"):  # the KL is ~1e-5 here: a difference of terms ~1 (`indexer_tol`)
        tol = indexer_tol(key, want[key], 12, 8 * 2 * 2)  # 8 queries of 12 keys a row, 2 rows, 2 layers
        assert max(abs(a - b) for a, b in zip(want[key], got[key])) < tol, key
    if mode == "sparse":
        assert max(abs(a - b) for a, b in zip(want["loss"], got["loss"])) < loss_tol(want["loss"], tokens, model.config)
    if mode == "warmup":  # the indexers learned the dense attention
        assert want["indexer_kl"][-1] < want["indexer_kl"][0]
    moved, own = engine.weights(), model.state_dict()
    assert max((moved[k] - own[k]).abs().max().item() for k in own) < updates.tol(tokens)
    changed = {k for k in own if not torch.equal(own[k], start[k])}
    indexers = {k for k in changed if ".indexer." in k}
    assert indexers and (changed == indexers if mode == "warmup" else changed > indexers)


def test_a_draft_layer_passes_through_every_export(glm5, tmp_path):
    """A GLM-5 checkpoint with its MTP layer (layer num_hidden_layers), in an engine that does not train it (RL and
    OPD): the export carries it as the checkpoint has it, and the transformers model the engine saves from loads it
    (`tests/test_megatron_mtp.py` trains it)."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.models import mtp
    model, tok = load_checkpoint(glm5)
    mtp.install(model, 1)
    save_checkpoint(model, tok, tmp_path / "draft")
    want = {k: v for k, v in load_checkpoint(tmp_path / "draft")[0].state_dict().items() if k.startswith("mtp.")}
    engine = MegatronTrainEngine(tmp_path / "draft", lr=1e-3)
    got = engine.hf_model().state_dict()
    assert want and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("ckpt", ["glm5", "adopted"])
def test_policy_updates_and_expert_balancing_equal_the_torch_engines(request, ckpt):
    """Three RL-style steps: the same gradient norms, weights, expert-load figures and bias moves. Prompts are
    distinct: the torch engine runs a shared prompt once, so its expert load would count those tokens once. With DSA
    adopted the indexers select as transformers' and stay as they were (only the ramp's adoption trains them)."""
    from posttrain.engines import train_engine
    glm5 = request.getfixturevalue(ckpt)
    moe = MoEConfig(bias_update_rate=0.01)
    engines = [train_engine(name, glm5, lr=1e-3, moe=moe) for name in ("torch", "megatron")]
    samples = _samples(engines[1].vocab_size)[1:]
    norms, stats, updates, config = [], [], Updates(engines[1]), engines[1].hf_config
    for engine, n in zip(engines, (1, 2)):  # at one thread and at two: their reductions block otherwise
        engine.train()
        with threads(n):
            for _ in range(3):
                loss, _, _ = engine.logprob_loss(samples, 1.0, lambda lp, ent: -(lp.sum() + 0.1 * ent.sum()) / 10)
                engine.backward(loss)
                norms.append(engine.step(1.0))
                stats.append(dict(engine.moe_stats))
    assert all(abs(a - b) < math.sqrt(i) * forward_tol(a, config)
               for i, (a, b) in enumerate(zip(norms[:3], norms[3:]), 1))
    # the load figures: of the tokens' expert counts (exact), summed over the experts
    experts = config.n_routed_experts
    assert all(set(a) == set(b) and all(abs(a[k] - b[k]) <= sum_tol(abs(a[k]), experts) for k in a)
               for a, b in zip(stats[:3], stats[3:]))
    assert stats[0]["moe_cv"] > 0
    moved, own = engines[1].weights(), engines[0].model.state_dict()
    assert max((moved[k] - own[k]).abs().max().item() for k in own) < updates.tol(_tokens(samples))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    start = load_checkpoint(glm5)[0].state_dict()[bias]
    three = sum_tol(start.abs().max().item() + 0.03, 3)  # three moves of 0.01, each added with one rounding
    assert (moved[bias] - start).abs().max().item() == pytest.approx(0.03, abs=three)
    start = load_checkpoint(glm5)[0].state_dict()
    assert all(torch.equal(moved[k], start[k]) for k in start if ".indexer." in k)


AUX = MoEConfig(bias_update_rate=0.01, aux_loss_weight=0.1)


@pytest.mark.parametrize("ckpt,par,lm", [("glm5", {"ep": 2}, True), ("glm5", {"ep": 2}, False),
                                         ("glm5", {"pp": 2}, False),
                                         ("glm5", {"ep": 2, "distributed_optimizer": True}, False),
                                         ("adopted", {"ep": 2}, True), ("adopted", {"cp": 2}, False),
                                         ("adopted", {"cp": 2, "train_indexers": ("sparse", 8, 0.5)}, True),
                                         ("glm5", {"cp": 2, "moe": AUX}, True),
                                         ("glm5", {"pp": 2, "micro_batches": 2, "moe": AUX}, True)],
                         ids=["ep2-lm", "ep2", "pp2", "ep2-distributed-optimizer", "ep2-dsa-lm", "cp2-dsa",
                              "cp2-dsa-adoption-lm", "cp2-balance-loss", "pp2-1f1b-balance-loss"])
def test_expert_and_pipeline_ranks_give_one_ranks_losses_and_update(request, tmp_path, gloo_pair, ckpt, par, lm):
    """ep2: four experts on each rank, tokens sent to them all-to-all; pp2: the dense layer on one stage, the MoE
    layer on the other; with the distributed optimizer each rank steps its own experts and about half the dense
    layers (which repeat over the two ranks); with DSA adopted each rank's indexers select the same keys, and over
    two context-parallel ranks each rank's queries select among the whole sequence's keys; the indexers train
    there as on one rank (each rank's indexer loss the share of its queries). With the balance loss each
    context-parallel rank adds its tokens' share of every row's, and two micro-batches on two stages each their
    rows' share of the batch's."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    glm5 = request.getfixturevalue(ckpt)
    out = str(tmp_path / "rank0.pt")
    gloo_pair.spawn(_rank, (2, _free_port(), par, glm5, out, lm, 2048))
    got = torch.load(out)
    one = MegatronTrainEngine(glm5, lr=1e-3, train_indexers=par.get("train_indexers"), moe=par.get("moe"))
    updates = Updates(one)
    with threads(2):  # the ranks run at one thread each
        want = [x.item() for x in _steps(one, _samples(one.vocab_size), lm)]
    # the last step's load figures and balance loss: sums over the step's tokens, after four steps' drift
    assert set(one.moe_stats) == set(got["moe"]) and all(
        abs(one.moe_stats[k] - got["moe"][k]) <= loss_tol([one.moe_stats[k]] * 4, STEP_TOKENS, one.hf_config)
        for k in got["moe"])
    assert ("moe_aux_loss" in got["moe"]) == ("moe" in par)
    assert set(one.indexer_stats) == set(got["indexer"]) and all(  # the last step's: KL ~1e-5, recall ~0.7
        abs(one.indexer_stats[k] - got["indexer"][k]) < indexer_tol(k, [one.indexer_stats[k]] * 4, 21, 8 * 2 * 2)
        for k in got["indexer"])  # 8 queries of each 21-token row, 2 rows, 2 layers
    assert max(abs(a - b) for a, b in zip(want, got["losses"])) < loss_tol(want, STEP_TOKENS, one.hf_config)
    w = one.weights()
    assert set(w) == set(got["weights"]) and \
        max((w[k] - got["weights"][k]).abs().max().item() for k in w) < updates.tol(STEP_TOKENS)
    assert got["owned"] < 0.9 if par.get("distributed_optimizer") else got["owned"] == 1  # the share it steps
    assert got["schedules"] == ([2] * 4 if par.get("pp") else [])  # RL's two micro-batches over the stages in 1F1B


@pytest.mark.parametrize("recompute", [False, True])
def test_the_balance_loss_trains_the_routers_as_the_torch_engines(glm5, recompute):
    """DeepSeek-V3's sequence-wise balance loss beside sft's LM loss (moe.aux_loss_weight), over padded rows and
    packed documents: the torch engine's `moe_aux_loss` curve, losses and weights; under recompute each value is
    counted once. The loss is no no-op: the routers end elsewhere than without it."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.train import train
    from posttrain.engines.torch_train import TorchTrainEngine
    from tests.test_megatron import _lm_batches
    batches = _lm_batches(load_checkpoint(glm5)[0].config.vocab_size)
    kw = dict(steps=4, lr=1e-2, warmup=1, desc="sft")
    model, _ = load_checkpoint(glm5)
    with threads(1):  # the torch engine at one thread, megatron at two: their reductions block otherwise
        want = train(TorchTrainEngine.for_lm(model, lr=1.0, moe=AUX), lambda i: batches[i % 2], **kw)
    engine = MegatronTrainEngine(glm5, lr=1.0, moe=AUX, recompute=recompute)
    updates = Updates(engine)
    with threads(2):
        got = train(engine, lambda i: batches[i % 2], **kw)
    assert len(got["moe_aux_loss"]) == 4 and max(abs(a - b) for a, b in zip(
        want["moe_aux_loss"], got["moe_aux_loss"])) < loss_tol(want["moe_aux_loss"], STEP_TOKENS, model.config)
    assert max(abs(a - b) for a, b in zip(want["loss"], got["loss"])) < \
        loss_tol(want["loss"], STEP_TOKENS, model.config)
    moved, own = engine.weights(), model.state_dict()
    assert max((moved[k] - own[k]).abs().max().item() for k in own) < updates.tol(STEP_TOKENS)
    plain = MegatronTrainEngine(glm5, lr=1.0, moe=MoEConfig(bias_update_rate=0.01))
    train(plain, lambda i: batches[i % 2], **kw)
    gate = "model.layers.1.mlp.gate.weight"
    assert (plain.weights()[gate] - moved[gate]).abs().max().item() > 1e-3


@pytest.mark.parametrize("par", [{"ep": 2}, {"ep": 2, "distributed_optimizer": True}],
                         ids=["ep2", "ep2-distributed-optimizer"])
def test_a_distributed_checkpoint_saved_over_two_expert_ranks_resumes_on_one_rank(glm5, tmp_path, gloo_pair, par):
    """Each expert-parallel rank writes its four experts and their AdamW moments (with the distributed optimizer
    also the dense layers' moments it owns); one rank holding all eight trains on from it as the two did (sft's
    resume after a SIGKILL goes through this checkpoint)."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    folder, out = tmp_path / "dist", str(tmp_path / "losses.pt")
    gloo_pair.spawn(_sharded_rank, (2, _free_port(), glm5, str(folder), out, par))
    want = torch.load(out)
    one = MegatronTrainEngine(glm5, lr=1e-3)
    one.load_sharded(folder)
    with threads(2):  # the ranks ran at one thread each
        got = [x.item() for x in _steps(one, [], lm=True)]
    assert max(abs(a - b) for a, b in zip(got, want)) < loss_tol(want * 2, STEP_TOKENS, one.hf_config)  # steps 5-8


def test_routing_replay_gives_the_rollouts_logprobs_after_the_routing_moved(glm5, tmp_path):
    """Routes recorded by the torch rollout engine, then the expert bias moved so that the router chooses otherwise:
    replayed through Megatron's router, the rollout's log-probabilities come back, and the router still learns."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.engines.torch_rollout import sample
    from posttrain.models import moe
    from posttrain.rl.workers import Sample
    model, tok = load_checkpoint(glm5)
    prompts = [[5, 6, 7, 8, 9, 10, 11]] * 3 + [[20, 21, 22]] * 3
    hooks = moe.RouterHooks(model)
    with threads(1):  # the rollout at one thread, the trainer at two: their reductions block otherwise
        gens = sample(model, prompts, max_new_tokens=10, temperature=1.0, stop_ids={2}, pad_id=0,
                      generator=torch.Generator().manual_seed(0), routes=hooks)
    hooks.remove()
    samples = [Sample("t", i // 3, p, g.ids, [1] * len(g.ids), g.logprobs, float(i % 2), 0, routes=g.routes)
               for i, (p, g) in enumerate(zip(prompts, gens))]
    with torch.no_grad():  # the choice moves, the gate values of a given choice do not (bias: choice only)
        for _, r in moe.routers(model):
            r.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    save_checkpoint(model, tok, tmp_path / "moved")
    behaviour = torch.nn.utils.rnn.pad_sequence([torch.tensor(g.logprobs) for g in gens], batch_first=True)
    real = behaviour != 0
    plain, replay = (MegatronTrainEngine(tmp_path / "moved", lr=1e-3, routing_replay=r) for r in (False, True))
    assert (plain.logprobs(samples, 1.0)[0][real] - behaviour[real]).abs().max() > 1e-2
    replay.train()
    with threads(2):
        loss, logp, _ = replay.logprob_loss(samples, 1.0, lambda lp, ent: -lp.sum())
    # the rollout's incremental decoding and the trainer's whole-row forward: other kernels (`forward_tol`)
    torch.testing.assert_close(logp[real], behaviour[real], rtol=0,
                               atol=forward_tol(behaviour[real].abs().max().item(), model.config))
    stats = replay.replay_stats()
    assert stats["routes_replayed"] > 0 and stats["routes_differ"] > 0.2
    replay.backward(loss)
    assert replay.gpt.decoder.layers[1].mlp.router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="routes of shape"):
        samples[0].routes = samples[0].routes[:, :, :1]
        replay.logprobs(samples, 1.0)


def test_the_router_methods_stay_on_the_glm5_engines_own_routers(glm5):
    """GLM-5's router methods (the expert load, routing replay, the balance loss) are bound to the routers of the
    engine's model only: megatron-core's router classes keep their own, and a router built after the engine routes
    with them."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    engine = MegatronTrainEngine(glm5, "reference")  # megatron-core imported after it (its CPU patches)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay
    ours = engine.gpt.decoder.layers[1].mlp.router
    assert all(getattr(ours, m).__func__.__module__ == "posttrain.engines.megatron.glm5"
               for m in ("routing", "_apply_expert_bias")) and \
        ours.router_replay.get_replay_topk.__func__.__module__ == "posttrain.engines.megatron.glm5"
    methods = [(TopKRouter, "routing"), (TopKRouter, "_apply_expert_bias"), (RouterReplay, "get_replay_topk")]
    assert all(vars(cls)[m].__module__.startswith("megatron.core.") for cls, m in methods)
    plain = TopKRouter(ours.config, ProcessGroupCollection.use_mpu_process_groups(["tp", "cp", "tp_cp", "tp_dp_cp"]))
    assert plain.routing.__func__ is TopKRouter.routing
    assert plain._apply_expert_bias.__func__ is TopKRouter._apply_expert_bias
    assert plain.router_replay.get_replay_topk.__func__ is RouterReplay.get_replay_topk
    assert not {"routing", "_apply_expert_bias"} & set(vars(plain))
    assert "get_replay_topk" not in vars(plain.router_replay)


def test_what_megatron_would_compute_differently_fails_before_any_work(glm5, adopted):
    from posttrain.engines.megatron import glm5 as megatron_glm5
    from posttrain.engines.megatron.layout import Parallel
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    with pytest.raises(ValueError, match=rf"{glm5}/config.json: megatron.ep: must divide the checkpoint's "
                                         r"n_routed_experts \(8\) \(got 3; supported: \[1, 2, 4, 8\]\)"):
        MegatronTrainEngine(glm5, parallel=Parallel(ep=3))
    with pytest.raises(ValueError, match="megatron.tp: Megatron splits a mixture-of-experts model over "
                                         "tensor-parallel ranks only with megatron.sequence_parallel"):
        MegatronTrainEngine(glm5, parallel=Parallel(tp=2))
    # a shared DSA layer must find its full layer's selection on its own pipeline stage
    with pytest.raises(ValueError, match=r"adopted\d*/config.json: megatron.pp: layer 1 shares layer 0's DSA "
                                         r"selection \(indexer_types 'shared'\) but would start another pipeline"):
        MegatronTrainEngine(adopted, parallel=Parallel(pp=2))
    # Transformer Engine's layers run no indexer: rows past index_topk refused there
    config = load_checkpoint(adopted)[0].config
    megatron_glm5.check_rows(config, 9, adopted, sparse=True)
    megatron_glm5.check_rows(config, 4, adopted, sparse=False)
    with pytest.raises(ValueError, match=r"a 9-token row is longer than .*adopted\d*/config.json's index_topk "
                                         r"\(4\), on Transformer Engine's layers"):
        megatron_glm5.check_rows(config, 9, adopted, sparse=False)
