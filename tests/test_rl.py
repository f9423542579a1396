import copy

import pytest
import torch

import environments
from posttrain.config import ModelConfig, RLConfig
from posttrain.engines.torch_train import TorchTrainEngine, policy_logits
from posttrain.models.preset import build_model, save_checkpoint
from posttrain.rl.loop import train_policy
from posttrain.rl.step import train_step
from posttrain.rl.losses import gae, group_advantages, policy_loss
from posttrain.rl.batches import completion_batch
from posttrain.models.prefix import prefix_forward
from posttrain.rl.rollout import episode_batch, token_logits
from posttrain.rl.workers import RolloutBuffer, RolloutWorker, Sample


@pytest.fixture(scope="module")
def ckpt(tok, tmp_path_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("policy")
    save_checkpoint(build_model(cfg, tok), tok, path)
    return str(path)



def _policy(model, tok, opt=None):
    """A model behind the local train engine with the test's own optimizer (None: forward only)."""
    return TorchTrainEngine(model, policy_logits(tok.pad_token_id), optimizer=opt)


def _critic(model, tok, opt):
    return TorchTrainEngine(model, lambda m, samples: m(samples, tok.pad_token_id), optimizer=opt)

def test_group_advantages_are_normalised_within_groups():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)
    assert torch.allclose(adv[:4].mean(), torch.tensor(0.0), atol=1e-6) and adv[0] > 0 > adv[1]
    assert torch.all(adv[4:] == 0)  # a group with one outcome carries no signal


def _pg(ratios: list[float], adv: float = 1.0, **kw):
    behaviour = torch.full((1, len(ratios)), -1.0)
    logp = (behaviour + torch.tensor(ratios).log()).requires_grad_()
    loss, stats = policy_loss(logp, behaviour, torch.tensor([adv]), torch.ones(1, len(ratios)), **kw)
    loss.backward()
    return logp.grad[0], stats


def test_policy_gradient_raises_logprob_of_rewarded_tokens():
    grad, stats = _pg([1.0, 1.0], clip_eps=0.2, is_lower=0.5, is_upper=2.0)
    assert torch.all(grad < 0) and abs(stats["ratio_mean"] - 1) < 1e-6  # descent raises both tokens


def test_double_sided_importance_sampling_masks_tokens_outside_the_bounds():
    grad, stats = _pg([1.0, 3.0, 0.3], clip_eps=0.2, is_lower=0.5, is_upper=2.0)
    assert grad[0] != 0 and grad[1] == 0 and grad[2] == 0
    assert stats["masked_fraction"] == pytest.approx(2 / 3)
    # PPO clipping alone would still push the low-ratio token (min picks its unclipped side)
    grad, stats = _pg([1.0, 3.0, 0.3], clip_eps=0.2, is_lower=1e-9, is_upper=1e9)
    assert grad[2] != 0 and stats["masked_fraction"] == 0


def test_gae_spreads_the_final_reward_over_generated_tokens_only():
    values = torch.tensor([[0.0, 0.2, 0.9, 0.5, 0.4]])
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0]])  # position 2 is a tool output, position 0 the prompt
    adv, ret = gae(values, torch.tensor([1.0]), mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv[0, [1, 3, 4]], torch.tensor([0.8, 0.5, 0.6]))  # Monte Carlo: R - V
    assert adv[0, 0] == 0 and adv[0, 2] == 0
    adv, _ = gae(values, torch.tensor([1.0]), mask, gamma=1.0, lam=0.0)
    assert torch.allclose(adv[0, [1, 3, 4]], torch.tensor([0.3, -0.1, 0.6]))  # one-step TD errors


def _group(version: int, group: int, n: int = 2) -> list[Sample]:
    return [Sample("t", group, [1], [2], [1], [-1.0], 1.0, version) for _ in range(n)]


def test_rollout_buffer_drops_samples_older_than_k_versions_and_counts_them():
    buf = RolloutBuffer(max_staleness=1)
    for v in (0, 1, 2):
        buf.add(_group(v, 0))
    batch = buf.take(1, version=3)
    assert [s.version for s in batch] == [2, 2] and buf.dropped == 4 and len(buf) == 0
    assert buf.staleness == {1: 2}


def test_training_uses_the_rollout_token_ids_even_where_retokenising_would_change_them(ckpt, tok):
    """Token in, token out: find a sampled completion that decode-then-encode changes, then show the
    trainer scored exactly the generated ids (ratio 1 against the behaviour logprobs, nothing masked)."""
    worker = RolloutWorker(ckpt)
    tasks = environments.get("reasoning").generate("train", 8, 0)
    samples, _ = worker.rollout(tasks, 2, seed=0, temperature=1.0, max_new_tokens=16, max_turns=1)
    drift = [s for s in samples if tok(tok.decode(s.ids), add_special_tokens=False)["input_ids"] != s.ids]
    assert drift, "no sample changed under re-tokenisation"
    s = drift[0]
    assert completion_batch([s, s])["ids"][0, :len(s.ids)].tolist() == s.ids
    r = RLConfig(lr=0.0, group_size=2)
    policy = worker.engine.model
    stats = train_step(r, _policy(policy.train(), tok, torch.optim.SGD(policy.parameters(), lr=0.0)), [s, s])
    assert abs(stats["ratio_mean"] - 1) < 1e-4 and stats["masked_fraction"] == 0 and stats["kl_behaviour"] < 1e-6


def test_prefix_shared_forward_equals_the_full_sequence_forward(ckpt, tok):
    """Each prompt runs once for its whole group; the logprobs of every completion token are unchanged."""
    worker = RolloutWorker(ckpt)
    tasks = environments.get("agentic").generate("train", 4, 0)  # multi-turn: tool output inside the completion
    samples, _ = worker.rollout(tasks, 3, seed=1, temperature=1.0, max_new_tokens=12, max_turns=2)
    model = worker.engine.model
    full = episode_batch(samples, tok.pad_token_id)
    lp_full = torch.log_softmax(token_logits(model, full), -1).gather(-1, full["input_ids"][:, 1:, None])[..., 0]
    cb = completion_batch(samples)
    logits = prefix_forward(model, samples, tok.pad_token_id)
    lp = torch.log_softmax(logits, -1).gather(-1, cb["ids"][..., None])[..., 0]
    for i, s in enumerate(samples):
        p = len(s.prompt_ids) - 1
        assert torch.allclose(lp[i, :len(s.ids)], lp_full[i, p:p + len(s.ids)], atol=1e-4)
        assert torch.allclose(lp[i, :len(s.ids)][cb["mask"][i, :len(s.ids)] > 0],
                              torch.tensor([x for x, g in zip(s.logprobs, s.gen_mask) if g]), atol=1e-4)


def test_padding_free_forward_equals_the_cached_forward_with_its_gradients(ckpt, tok):
    """One row per batch, no padding, no cache (models.prefix.flat_forward): the same logits, hidden states and
    gradients as the prefix-cached path; taken where samples do not share prompts enough to pay for padding."""
    from types import SimpleNamespace

    from posttrain.models.attention import padding_free
    from posttrain.models.prefix import cached_tokens, flat_tokens, pad_rows
    from posttrain.models.value import ValueModel
    g = torch.Generator().manual_seed(0)

    def sample(prompt: list[int], n: int):
        return SimpleNamespace(prompt_ids=prompt, ids=torch.randint(3, 200, (n,), generator=g).tolist())
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 20, 9, 14)]
    one_each = [sample(p, n) for p, n in zip(prompts, (3, 25, 7, 16))]  # lengths apart: the flat row is cheaper
    assert flat_tokens(one_each) < cached_tokens(one_each)
    many = [sample(p, 4) for p in prompts[1:3] for _ in range(8)]  # GRPO-sized groups: the prompts' cache is cheaper
    assert flat_tokens(many) > cached_tokens(many)
    worker = RolloutWorker(ckpt)
    cached_model = copy.deepcopy(worker.engine.model).train()  # sdpa: the cached path
    flat_model = copy.deepcopy(worker.engine.model).train()
    assert padding_free(flat_model) and flat_model.config._attn_implementation == "varlen_sdpa"
    real = pad_rows([[True] * len(s.ids) for s in one_each], False, torch.bool)
    results = []
    for model in (cached_model, flat_model):
        logits = prefix_forward(model, one_each, tok.pad_token_id)
        logits.log_softmax(-1)[real].max(-1).values.sum().backward()
        hidden = prefix_forward(model, one_each, tok.pad_token_id, "hidden")[0]
        results.append((logits[real], hidden[real],
                        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    critic = ValueModel(ckpt)  # the critic's backbone too
    assert critic.backbone.config._attn_implementation == "varlen_sdpa"
    plain = ValueModel(ckpt).backbone
    plain.set_attn_implementation("sdpa")
    with torch.no_grad():
        flat = prefix_forward(critic.backbone, one_each, tok.pad_token_id, "last_hidden_state")
        cached = prefix_forward(plain, one_each, tok.pad_token_id, "last_hidden_state")
    torch.testing.assert_close(flat[real], cached[real], atol=1e-4, rtol=1e-4)


def test_groups_without_signal_skip_the_forward_pass_and_the_update_is_unchanged(ckpt, tok):
    worker = RolloutWorker(ckpt)
    samples, _ = worker.rollout(environments.get("general").generate("train", 4, 0), 4, seed=0, temperature=1.0,
                                max_new_tokens=8, max_turns=1)
    samples[0].reward = 1.0  # group 0 has signal; give group 1 none
    for s in samples[4:8]:
        s.reward = 0.5
    params = []
    for agg in ("token", "sequence"):
        for entropy_coef in (0.0, 1e-12):  # any entropy or KL term needs every row, so it turns skipping off
            model = copy.deepcopy(worker.engine.model)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            train_step(RLConfig(group_size=4, loss_agg=agg, entropy_coef=entropy_coef), _policy(model.train(), tok, opt),
                       samples)
            params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert torch.allclose(params[-2], params[-1], atol=1e-6), agg


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_micro_batches_accumulate_to_the_full_batch_update(ckpt, tok, algorithm):
    """Length-sorted micro-batches (one sample each here) give the same policy and critic update as one batch."""
    from posttrain.models.value import ValueModel
    worker = RolloutWorker(ckpt)
    samples, _ = worker.rollout(environments.get("agentic").generate("train", 2, 0), 4, seed=3, temperature=1.0,
                                max_new_tokens=10, max_turns=2)
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    params = []
    for cells in (1, 10**6):
        policy, critic = copy.deepcopy(worker.engine.model), ValueModel(ckpt) if algorithm == "ppo" else None
        r = RLConfig(algorithm=algorithm, group_size=4, micro_batch_cells=cells, kl_coef=0.1)
        train_step(r, _policy(policy.train(), tok, torch.optim.SGD(policy.parameters(), lr=1.0)), samples,
                   critic and _critic(critic, tok, torch.optim.SGD(critic.parameters(), lr=1.0)),
                   _policy(copy.deepcopy(policy), tok))
        params.append(torch.cat([p.detach().flatten() for m in (policy, critic) if m for p in m.parameters()]))
    before = torch.cat([p.detach().flatten() for p in worker.engine.model.parameters()])
    assert not torch.allclose(params[1][:before.numel()], before)  # the update did something
    assert torch.allclose(params[0], params[1], atol=1e-5)


@pytest.mark.parametrize("k", [0, 1])
def test_staleness_bound_k_is_what_the_trainer_sees(ckpt, k):
    tasks = environments.get("reasoning").generate("train", 32, 0)
    r = RLConfig(steps=3, prompts_per_step=2, group_size=2, max_new_tokens=8, max_staleness=k, val_every=0,
                 lr=1e-3, stop_check=False)  # untrained weights never stop
    _, _, st = train_policy(r, ckpt, tasks, tasks[:4], seed=0)
    assert sum(st.staleness.values()) == 3 * 2 * 2 and st.dropped == 0
    assert set(st.staleness) == ({0} if k == 0 else {0, 1})  # k=1: generation ran one version ahead
    h = st.history
    assert len(h["reward"]) == 3 and len(h["val_score"]) == 2  # before, and after the last step
    for key in ("reward_std", "masked_fraction", "kl_behaviour", "entropy", "gen_tokens_per_s", "train_tokens_per_s",
                "staleness_mean", "stale_dropped", "rollout_wait_s", "train_s", "push_s"):
        assert len(h[key]) == 3, key
    # where the trainer's time went: within the step's wall time (validation is not in a step's split)
    assert all(h[k][i] >= 0 for k in ("rollout_wait_s", "train_s", "push_s") for i in range(3))
    assert sum(h["rollout_wait_s"] + h["train_s"] + h["push_s"]) <= h["wall_s"][-1]


def test_validation_every_n_student_tokens(ckpt):
    """`val_every_tokens`: validation at the first step past each multiple of n generated tokens, so methods
    whose steps differ in size are compared at the same token budgets."""
    tasks = environments.get("reasoning").generate("train", 32, 0)
    r = RLConfig(steps=4, prompts_per_step=2, group_size=2, max_new_tokens=8, val_every=0, val_every_tokens=10,
                 stop_check=False)  # untrained weights never stop
    _, _, st = train_policy(r, ckpt, tasks, tasks[:2], seed=0)
    tokens = st.history["student_tokens"]
    crossed = {i + 1 for i, t in enumerate(tokens) if t // 10 > (tokens[i - 1] if i else 0) // 10}
    assert crossed and {s for s, _ in st.history["val_score"]} == {0, 4} | crossed


def test_ppo_trains_a_critic_on_single_rollouts(ckpt):
    tasks = environments.get("agentic").generate("train", 16, 0)
    r = RLConfig(algorithm="ppo", group_size=1, steps=2, prompts_per_step=4, max_new_tokens=8, max_turns=2,
                 val_every=0, kl_coef=0.1, stop_check=False)  # untrained weights never stop
    _, _, st = train_policy(r, ckpt, tasks, tasks[:2], seed=0)
    assert len(st.history["value_loss"]) == 2 and len(st.history["kl_ref"]) == 2


def test_critic_learns_and_its_value_clip_binds_from_the_second_epoch(ckpt, tok):
    """Critic PPO on one fixed batch (Monte Carlo returns, so the target stays put): the value loss falls and
    the explained variance rises. With one pass the values never moved since they were taken, so the clip
    cannot bind; with two passes per batch it does."""
    from posttrain.models.value import ValueModel
    from posttrain.engines.optim import make_optimizer
    worker = RolloutWorker(ckpt)
    samples, _ = worker.rollout(environments.get("agentic").generate("train", 8, 0), 1, seed=0, temperature=1.0,
                                max_new_tokens=8, max_turns=1)
    for i, s in enumerate(samples):
        s.reward = float(i % 2)
    for epochs in (1, 2):
        torch.manual_seed(0)
        policy, critic = copy.deepcopy(worker.engine.model).train(), ValueModel(ckpt)
        r = RLConfig(algorithm="ppo", group_size=1, gae_lambda=1.0, ppo_epochs=epochs, value_clip=0.05, lr=1e-4)
        opt, copt = make_optimizer(policy, r.lr), make_optimizer(critic, 3e-3)
        pe, ce = _policy(policy, tok, opt), _critic(critic, tok, copt)
        hist = [train_step(r, pe, samples, ce) for _ in range(12)]
        assert hist[-1]["value_loss"] < 0.5 * hist[0]["value_loss"], [h["value_loss"] for h in hist]
        assert hist[-1]["explained_variance"] > hist[0]["explained_variance"] + 0.2
        clip = [h["value_clip_frac"] for h in hist]
        assert (max(clip) > 0) == (epochs > 1), clip
        assert all(h["grad_norm"] > 0 and h["critic_grad_norm"] > 0 for h in hist)


def test_per_specialist_overrides_are_validated_with_their_key():
    r = RLConfig(per_domain={"agentic": {"algorithm": "ppo", "group_size": 1}})
    assert r.for_domain("agentic").algorithm == "ppo" and r.for_domain("general").algorithm == "grpo"
    with pytest.raises(ValueError, match="rl.per_domain.agentic.algo: unknown key"):
        RLConfig(per_domain={"agentic": {"algo": "ppo"}})
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        RLConfig(group_size=1)


def test_the_fused_heads_gradient_made_in_the_forward_gives_the_full_logits_update(ckpt, tok, monkeypatch):
    """The policy loss, its entropy bonus and its KL to a reference, differentiated chunk by chunk in the forward
    (TrainEngine.logprob_loss on the fused head) against the full logits: the same loss, statistics and update."""
    from posttrain.models import head
    worker = RolloutWorker(ckpt)
    samples, _ = worker.rollout(environments.get("general").generate("train", 2, 0), 4, seed=5, temperature=1.0,
                                max_new_tokens=10, max_turns=1)
    for i, s in enumerate(samples):
        s.reward = float(i % 2)
    # a token the behaviour found very unlikely: its ratio is finite (masked out), but with another chunk's tokens
    # zeroed while one chunk is differentiated, exp(0 + 90) overflows: only that chunk's terms may reach its gradient
    gen = [i for i, m in enumerate(samples[0].gen_mask) if m]
    samples[0].logprobs[gen[0]] = -90.0
    for agg in ("token", "sequence"):
        out = []
        for forced in ("0", "1"):
            monkeypatch.setenv(head.ENV, forced)
            model = copy.deepcopy(worker.engine.model)
            r = RLConfig(group_size=4, loss_agg=agg, entropy_coef=0.01, kl_coef=0.1, is_lower=0.9, is_upper=1.1)
            ref = _policy(copy.deepcopy(model).eval(), tok)
            st = train_step(r, _policy(model.train(), tok, torch.optim.SGD(model.parameters(), lr=1.0)), samples,
                            None, ref)
            out.append((st, torch.cat([p.detach().flatten() for p in model.parameters()])))
        (full, p_full), (fused, p_fused) = out
        assert not torch.allclose(p_full, torch.cat([p.detach().flatten() for p in worker.engine.model.parameters()]))
        assert torch.allclose(p_full, p_fused, atol=1e-5), agg
        for k in ("loss", "entropy", "kl_ref", "masked_fraction"):
            assert full[k] == pytest.approx(fused[k], abs=1e-5), (agg, k)


def _scripted_validation(monkeypatch, scores: list[float]) -> list[dict]:
    """Validation that returns `scores` in order and records the weights each call saw."""
    import posttrain.rl.loop as loop
    seen = []
    monkeypatch.setattr(loop, "as_rollout_engine", lambda model, tok: model)

    def fake(model, tok, val, **kw):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {"all": scores[len(seen) - 1]}
    monkeypatch.setattr(loop, "val_scores", fake)
    return seen


def test_keep_best_writes_the_best_validated_weights_and_a_resumed_run_keeps_them(ckpt, monkeypatch, tmp_path):
    """rl.keep best: the stage hands on the weights of its best validation (ties: the later step), not the last
    step's; with a scratch dir the copy survives a resume from a checkpoint taken after it."""
    tasks = environments.get("reasoning").generate("train", 32, 0)
    # the entropy bonus moves the weights where an untrained policy earns no reward
    r = RLConfig(steps=4, prompts_per_step=2, group_size=2, max_new_tokens=8, val_every=1, checkpoint_every=2,
                 lr=1e-2, entropy_coef=0.1, keep="best", stop_check=False)  # untrained weights never stop
    seen = _scripted_validation(monkeypatch, [0.5, 0.9, 0.2, 0.9, 0.1])  # steps 0..4: step 3 ties step 1, later wins
    model, _, st = train_policy(r, ckpt, tasks, tasks[:2], seed=0, scratch=tmp_path)
    assert st.kept == (3, 0.9)
    out = model.state_dict()
    assert all(torch.equal(out[k], seen[3][k]) for k in out)
    assert any(not torch.equal(seen[3][k], seen[4][k]) for k in out)  # training moved the weights after step 3
    assert [p.name for p in tmp_path.glob("best_step*.pt")] == ["best_step1.pt"]  # as of the step-2 checkpoint

    # the scratch still holds the step-2 checkpoint: a rerun resumes there, with step 1 the best so far
    seen.clear()
    scores = [0.3, 0.1, 0.0, 0.0]  # steps 3 and 4 (then the step-1 run below): step 1 (0.9, from the file) stays
    monkeypatch.setattr("posttrain.rl.loop.val_scores", lambda m, t, v, **kw: {"all": scores.pop(0)})
    model, _, st = train_policy(r, ckpt, tasks, tasks[:2], seed=0, scratch=tmp_path)
    assert st.kept == (1, 0.9)
    first = train_policy(r.model_copy(update={"steps": 1, "keep": "last"}), ckpt, tasks, tasks[:2], seed=0)[0]
    assert all(torch.equal(model.state_dict()[k], first.state_dict()[k]) for k in out)


class _ScriptedPool:
    """Rollout workers whose rewards are a function of the prompt: `agree(task)` true gives every sample of its
    group the same reward, false one right and the rest wrong."""

    def __init__(self, agree):
        self.agree, self.requests = agree, 0

    def __len__(self) -> int:
        return 1

    def submit(self, worker, tasks, group_size, seed, **kw):
        from concurrent.futures import Future
        self.requests += 1
        out = [Sample(t.id, g, [1], [2], [1], [0.0], float(self.agree(t) or i == 0), 0)
               for g, t in enumerate(tasks) for i in range(group_size)]
        f = Future()
        f.set_result((out, {"seconds": 1.0, "tokens": len(out)}))
        return f


@pytest.mark.parametrize("cap", [0, 2, 100])
def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(cap):
    from posttrain.rl.loop import Feed, State
    pool = environments.get("reasoning").generate("train", 64, 0)
    mixed = {t.id for t in pool[:16]}  # a quarter of the prompts give a group with signal
    workers = _ScriptedPool(lambda t: t.id not in mixed)
    r = RLConfig(prompts_per_step=4, group_size=4, max_staleness=0, dynamic_sampling=cap)
    feed = Feed(r, pool, None, workers, seed=0, st=State(), kw={})
    batch, _, _, _ = feed.collect(0)
    groups = {}
    for s in batch:
        groups.setdefault((s.task_id, s.group), []).append(s.reward)
    signal = sum(len(set(g)) > 1 for g in groups.values())
    assert len(batch) == 4 * 4  # a full batch, whatever was set aside
    if cap == 0:  # off: the first prompts drawn, agreeing or not
        assert workers.requests == 1 and signal == sum(t in mixed for t, _ in groups)
    elif cap == 2:  # at most 8 groups drawn; the set-aside ones fill what those lacked
        assert workers.requests == 2 and feed.drawn == 8 and signal == 8 - len(feed.uniform) < 4
    else:  # drawn until every group of the step differs
        assert signal == 4 and feed.drawn - len(feed.uniform) >= 4 and feed.uniform  # the rest wait in the buffer
    with pytest.raises(ValueError, match="dynamic_sampling"):
        RLConfig(algorithm="ppo", group_size=1, dynamic_sampling=2)
