"""The engine seam: what the RL loop, teachers and evaluation rely on from a rollout and a train engine."""
import threading

import pytest
import torch

import environments
from posttrain.chat import chat_format, render_ids
from posttrain.config import ConfigError, ModelConfig, load_config
from posttrain.engines import check, rollout_engine, train_engine
from posttrain.models.preset import build_model, save_checkpoint
from posttrain.rl.workers import RolloutWorker


@pytest.fixture(scope="module")
def ckpts(tok, tmp_path_factory):
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(f"ckpt{seed}")
        save_checkpoint(build_model(cfg, tok), tok, path)
        out.append(str(path))
    return out


def _prompts(tok, n=3):
    return [render_ids(tok, t.messages(), add_generation_prompt=True)
            for t in environments.get("reasoning").generate("test", n, 0)]


def test_generation_reports_its_stop_reason(ckpts, tok):
    engine = rollout_engine("torch", ckpts[0])
    prompts = _prompts(tok)
    free = engine.generate(prompts, max_new_tokens=6, temperature=0.0, stop_ids=set())
    assert all(g.stop_reason == "length" and len(g.ids) == len(g.logprobs) == 6 for g in free)
    stop = free[0].ids[2]  # the third greedy token ends the first row there
    cut = engine.generate(prompts, max_new_tokens=6, temperature=0.0, stop_ids={stop})
    assert cut[0].stop_reason == "stop" and cut[0].ids == free[0].ids[:free[0].ids.index(stop) + 1]


def test_update_weights_from_a_folder_or_a_state_dict_and_the_version(ckpts, tok):
    prompts, kw = _prompts(tok), dict(max_new_tokens=8, temperature=0.0, stop_ids=set())

    def out(engine):  # ids and their logprobs: an untrained model's greedy ids alone may agree by chance
        gens = engine.generate(prompts, **kw)
        return [g.ids for g in gens], torch.tensor([g.logprobs for g in gens])

    ids, lp = out(rollout_engine("torch", ckpts[1]))
    by_disk, by_tensor = rollout_engine("torch", ckpts[0]), rollout_engine("torch", ckpts[0])
    assert not torch.allclose(out(by_disk)[1], lp, atol=1e-3)
    by_disk.update_weights(ckpts[1], version=3)
    by_tensor.update_weights(train_engine("torch", ckpts[1]).weights(), version=4)
    for engine, version in ((by_disk, 3), (by_tensor, 4)):
        got_ids, got_lp = out(engine)
        assert got_ids == ids and torch.allclose(got_lp, lp, atol=1e-5) and engine.version == version


def test_a_bf16_rollout_engine_samples_near_the_fp32_ones_distribution_and_takes_fp32_weights(ckpts, tok):
    """rl.rollout_dtype bfloat16: the weights are held in bf16, the behaviour log-probabilities come out near fp32's
    (the gap the importance ratio absorbs) but not equal, and fp32 weights pushed by the trainer load into it."""
    prompts, kw = _prompts(tok), dict(max_new_tokens=8, temperature=0.0, stop_ids=set())
    fp32, bf16 = rollout_engine("torch", ckpts[0]), rollout_engine("torch", ckpts[0], "bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    a, b = (torch.tensor([g.logprobs for g in e.generate(prompts, **kw)]) for e in (fp32, bf16))
    assert 0 < (a - b).abs().max() < 0.1
    bf16.update_weights(train_engine("torch", ckpts[1]).weights(), version=1)
    want = torch.tensor([g.logprobs for g in rollout_engine("torch", ckpts[1]).generate(prompts, **kw)])
    assert (torch.tensor([g.logprobs for g in bf16.generate(prompts, **kw)]) - want).abs().max() < 0.1


def test_a_w4a8_rollout_engine_generates_from_integer_layers_and_quantizes_each_pushed_policy(ckpts, tok):
    """rl.rollout_dtype w4a8: the engine generates from the quantize stage's integer scheme (rounded to nearest), near
    fp32's log-probabilities but not equal, and fp32 weights pushed by the trainer are quantized again: after the
    push it generates exactly as a W4A8 engine started from those weights."""
    from posttrain.quant.int_linear import IntLinear
    prompts, kw = _prompts(tok), dict(max_new_tokens=8, temperature=0.0, stop_ids=set())
    fp32, w4a8 = rollout_engine("torch", ckpts[0]), rollout_engine("torch", ckpts[0], "w4a8")
    assert sum(isinstance(m, IntLinear) for m in w4a8.model.modules()) == 7 * w4a8.model.config.num_hidden_layers
    a, b = (torch.tensor([g.logprobs for g in e.generate(prompts, **kw)]) for e in (fp32, w4a8))
    assert 0 < (a - b).abs().max() < 0.1
    w4a8.update_weights(train_engine("torch", ckpts[1]).weights(), version=1)
    fresh = rollout_engine("torch", ckpts[1], "w4a8")
    got, want = ([g.logprobs for g in e.generate(prompts, **kw)] for e in (w4a8, fresh))
    assert got == want and w4a8.version == 1
    with pytest.raises(ConfigError, match=r"rl.rollout_dtype: w4a8 runs on posttrain's integer kernels \(torch;"):
        load_config("smoke-dense", ["rl.rollout_dtype=w4a8", "runtime.rollout_engine=sglang"])


def test_what_an_engine_cannot_do_is_refused_at_load_from_its_declared_capabilities():
    """posttrain.engines.registry: each message names the key, the engines that can, and the one configured."""
    glm5 = ["model.arch=glm5", "model.num_layers=2", "rl.routing_replay=true"]
    with pytest.raises(ConfigError, match=r"rl.routing_replay: the sglang rollout engine does not record expert routes "
                                          r"\(torch does; got runtime.rollout_engine 'sglang'\)"):
        load_config("smoke-dense", [*glm5, "runtime.rollout_engine=sglang"])
    with pytest.raises(ConfigError, match=r"rl.partial_rollouts: needs a rollout engine that takes weights "
                                          r"mid-generation \(sglang; got runtime.rollout_engine 'torch'\)"):
        load_config("smoke-dense", ["rl.partial_rollouts=true", "rl.max_staleness=1"])
    assert load_config("smoke-dense", glm5).rl.routing_replay  # the torch engines can


def test_a_paused_engine_generates_nothing_until_resumed(ckpts, tok):
    engine, done = rollout_engine("torch", ckpts[0]), []
    engine.pause()
    t = threading.Thread(target=lambda: done.append(engine.generate(_prompts(tok, 1), max_new_tokens=2,
                                                                    temperature=0.0, stop_ids=set())))
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive() and not done  # held while paused
    engine.resume()
    t.join()
    assert len(done[0]) == 1


def test_train_engine_state_resumes_exactly(ckpts, tok):
    """Weights, optimizer moments and RNG: a step after load equals the step after save."""
    worker = RolloutWorker(ckpts[0])
    samples, _ = worker.rollout(environments.get("reasoning").generate("train", 2, 0), 2, seed=0, temperature=1.0,
                                max_new_tokens=6, max_turns=1)

    def step(engine):
        logits = engine.forward(samples)
        loss = logits.log_softmax(-1)[..., 0].mean() * torch.rand(())  # the same step only with the same RNG
        engine.backward(loss)
        return engine.step(1.0)

    engine = train_engine("torch", ckpts[0], lr=1e-2)
    step(engine)
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in engine.state_dict()["model"].items()}
    state = torch.serialization.pickle.loads(torch.serialization.pickle.dumps(engine.state_dict()))
    step(engine)
    after = [p.detach().clone() for p in engine.model.parameters()]
    other = train_engine("torch", ckpts[0], lr=1e-2)
    other.load_state_dict(state)
    assert all(torch.equal(saved[k], v) for k, v in other.model.state_dict().items())
    step(other)
    assert all(torch.equal(a, p) for a, p in zip(after, other.model.parameters()))
    assert engine.tokenizer is not None and chat_format(engine.tokenizer).pad_id == chat_format(tok).pad_id


def test_critic_and_reference_roles(ckpts):
    critic, ref = train_engine("torch", ckpts[0], "critic", lr=1e-3), train_engine("torch", ckpts[0], "reference")
    assert ref.opt is None and critic.opt is not None
    worker = RolloutWorker(ckpts[0])
    samples, _ = worker.rollout(environments.get("reasoning").generate("train", 1, 0), 2, seed=0, temperature=1.0,
                                max_new_tokens=4, max_turns=1)
    assert critic.forward(samples).shape == (2, max(len(s.ids) for s in samples))  # one value per position


def test_unknown_engines_are_refused_by_name():
    with pytest.raises(ValueError, match=r"runtime.rollout_engine: unknown engine 'vllm' \(known: sglang, torch\)"):
        check({"runtime.rollout_engine": "vllm"})
    with pytest.raises(ValueError,
                       match=r"runtime.train_engine: unknown engine 'deepspeed' \(known: megatron, torch\)"):
        check({"runtime.train_engine": "deepspeed"})


def test_the_decode_cache_writes_in_place_and_matches_transformers_cache(ckpts, tok):
    """Decoding writes each token's keys into spare room (no copy of the whole cache per token); what the model
    sees is what transformers' own cache gives it: same greedy tokens and log-probabilities, rows dropped and
    steps cropped alike."""
    from transformers import DynamicCache

    from posttrain.engines import torch_rollout
    from posttrain.models.kv_cache import decode_cache
    model = rollout_engine("torch", ckpts[0]).model
    prompts = _prompts(tok, 4)
    prompts[1] = prompts[1][:-5]  # rows of different lengths, and two rows sharing a prompt
    prompts.append(prompts[0])
    kw = dict(max_new_tokens=20, temperature=0.0, pad_id=0)
    free = torch_rollout.sample(model, prompts, stop_ids=set(), **kw)
    kw["stop_ids"] = {free[0].ids[3], free[2].ids[6]}  # rows finish early and leave the batch
    ours = torch_rollout.sample(model, prompts, **kw)
    orig = torch_rollout.decode_cache
    torch_rollout.decode_cache = lambda reserve, model=None: DynamicCache()
    try:
        ref = torch_rollout.sample(model, prompts, **kw)
    finally:
        torch_rollout.decode_cache = orig
    assert [g.ids for g in ours] == [g.ids for g in ref] and any(g.stop_reason == "stop" for g in ours)
    assert all(torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5) for a, b in zip(ours, ref))

    cache, ref = decode_cache(reserve=4), DynamicCache()  # outgrows its room: doubles
    for n in (3, 1, 1, 2):
        k, v = torch.randn(3, 2, n, 8), torch.randn(3, 2, n, 8)
        got, want = cache.update(k, v, 0), ref.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rows = torch.tensor([2, 0])
    cache.batch_select_indices(rows)
    ref.batch_select_indices(rows)
    cache.crop(-2)
    ref.crop(-2)
    k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    got, want = cache.update(k, v, 0), ref.update(k, v, 0)
    assert cache.get_seq_length() == ref.get_seq_length() == 6 and torch.equal(got[0], want[0])
