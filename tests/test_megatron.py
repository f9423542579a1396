"""The megatron-core train engine: Hugging Face weights in and out exactly, the same numbers as transformers and the
torch engine, and tensor / data parallel over two gloo processes equal to one rank."""
import contextlib
import math
import os
import random
import socket
import warnings
from types import SimpleNamespace as NS

import pytest
import torch

from posttrain.config import ConfigError, ModelConfig, load_config
from posttrain.models.preset import build_model, save_checkpoint

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

# --- how far two fp32 runs of the same computation may part (docs/megatron.md, "Test tolerances") ---------------------
# The engines and splits compared here sum the same terms in other orders (ranks, kernels, thread counts' blocking),
# so their results part by rounding. The bounds below follow from fp32's unit roundoff u = EPS32 / 2 and the size and
# count of what is summed, never from what one CPU gave: each of a sum's n additions rounds by at most u times its
# partial sum, as if uniformly at random (Higham and Mary's probabilistic rounding analysis), so a sum whose partial
# sums stay within M is off by u M sqrt(n / 3) standard deviations, and two runs' differ by sqrt(2) of that; a bound
# is SIGMAS of those. A missing or doubled term parts them by that term: 1e-3 and more here.
EPS32 = torch.finfo(torch.float32).eps  # 2^-23: fp32's spacing at 1
SIGMAS = 6.0
# AdamW divides each gradient by its running root-mean-square + eps. Where an element's gradient is near zero (of the
# 1e4..1e5 elements some are, at any step), a rounding delta of it moves the update by up to lr * delta / eps: at
# torch's eps 1e-8 one rounding of a 1e-3 gradient (1e-10) is 1e-2 of lr, the size of a real difference, and a
# router's near-tie then breaks the other way. The compared runs take eps = ADAM_EPS (`steady_adam`), still under
# nearly every element's gradient (their root-mean-square: 1e-3 and more here), so AdamW still divides them by their
# own size; the engines' own AdamW is not changed.
ADAM_EPS = 1e-5


def sum_tol(magnitude: float, n: int) -> float:
    """Two runs of a sum of `n` fp32 additions, each rounding at most half an ulp of `magnitude`."""
    return SIGMAS * EPS32 * magnitude * math.sqrt(n / 6)


def chain(config) -> int:
    """The additions along a forward (or backward) pass through `config`'s model to one output: each layer sums over
    the hidden size in its four projections and over the intermediate size in its MLP, the head over the hidden size."""
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    return config.num_hidden_layers * (4 * config.hidden_size + width) + config.hidden_size


def forward_tol(magnitude: float, config) -> float:
    """An output of `magnitude` of a forward or backward pass through `config`'s model, by other kernels or splits:
    the roundings along its `chain` add up as a sum's."""
    return sum_tol(magnitude, chain(config))


def loss_tol(losses, tokens: int, config) -> float:
    """Losses of `config`'s model over `tokens` positions, step after step. Each step's is a mean over the positions
    of terms each `forward_tol` off (independently: chain / tokens additions' worth in the mean), summed in another
    order (tokens more); each update (itself off by rounding) perturbs the later steps as much again, independently
    of the others': step t, sqrt(t) of them."""
    return math.sqrt(len(losses)) * sum_tol(max(abs(x) for x in losses), tokens + chain(config) / tokens)


@contextlib.contextmanager
def threads(n: int):
    """torch at `n` threads inside: the compared sides at different counts, so their reductions block otherwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def steady_adam():
    """`posttrain.engines.optim.make_optimizer` (the torch and megatron engines' AdamW) at eps ADAM_EPS inside."""
    import posttrain.engines.optim as T
    make = T.make_optimizer

    def steady(*args, **kwargs):
        opt = make(*args, **kwargs)
        for group in opt.param_groups:
            group["eps"] = ADAM_EPS
        return opt
    T.make_optimizer = steady
    try:
        yield
    finally:
        T.make_optimizer = make


class Updates:
    """What an engine's AdamW did, step by step: its learning rate and the root-mean-square of the gradient's elements
    (after clipping). `tol(tokens)`: how far the weights of two runs of those steps may part. A gradient element is a
    backward pass's output (its `chain`) summed over `tokens` positions; one near zero (the kind AdamW amplifies) sums
    terms of a typical element's size, the root-mean-square, so the two runs' part by sum_tol(rms, chain + tokens).
    AdamW turns that into at most lr * sum_tol / eps of update (its update g / (sqrt(v) + eps) moves by at most 1/eps
    per unit of g), and the steps' add up."""

    def __init__(self, engine):
        self.steps: list[tuple[float, float]] = []
        self.chain = chain(engine.hf_config)
        engine.opt.register_step_pre_hook(self._record)

    def _record(self, opt, args, kwargs) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        square = sum(g.double().pow(2).sum().item() for g in grads)
        rms = math.sqrt(square / max(1, sum(g.numel() for g in grads)))
        self.steps.append((float(opt.param_groups[0]["lr"]), rms))

    def tol(self, tokens: int) -> float:
        return sum(lr * sum_tol(rms, self.chain + tokens) / ADAM_EPS for lr, rms in self.steps)


@pytest.fixture(autouse=True)
def _steady_adam():
    with steady_adam():
        yield


@pytest.fixture(scope="module", autouse=True)
def _process_groups(megatron_groups):
    """The engine opens a world of one in this process; later tests open their own (conftest)."""


@pytest.fixture(scope="module")
def ckpts(tok, tmp_path_factory):
    """The tiny Llama preset (tied embeddings, grouped-query attention) and a Qwen2 (untied, QKV bias) and a Qwen3
    (query / key norms) of the same size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position_embeddings=256)
    out = {"llama": tmp_path_factory.mktemp("llama")}
    save_checkpoint(build_model(cfg, tok), tok, out["llama"])
    # reloaded as a Qwen2 tokenizer, ours gains Qwen's <|endoftext|>: rows to spare, as real checkpoints have
    shape = dict(vocab_size=len(tok) + 8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=False,
                 pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    for name, config, cls in (("qwen2", Qwen2Config, Qwen2ForCausalLM), ("qwen3", Qwen3Config, Qwen3ForCausalLM)):
        model = cls(config(**shape, **({"head_dim": 8} if name == "qwen3" else {}))).float()
        with torch.no_grad():  # transformers zero-initialises biases and ones the norms: make each one count
            for n, p in model.named_parameters():
                if n.endswith("bias") or "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
        out[name] = tmp_path_factory.mktemp(name)
        save_checkpoint(model, tok, out[name])
    return {k: str(v) for k, v in out.items()}


def _samples(vocab: int, seed: int = 0) -> list:
    """Two samples share a prompt (GRPO's groups); completions of different lengths; one token not generated."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()
    prompt = ids(6)
    out = [NS(prompt_ids=prompt, ids=ids(n), gen_mask=[1] * n) for n in (4, 7)]
    out += [NS(prompt_ids=ids(3), ids=ids(2), gen_mask=[1, 0]), NS(prompt_ids=ids(9), ids=ids(5), gen_mask=[1] * 5)]
    return out


def _tokens(samples: list) -> int:
    """The positions a forward over `samples` runs (each gradient element sums over them)."""
    return sum(len(s.prompt_ids) + len(s.ids) for s in samples)


def _engines(path, role="policy", lr=1e-3):
    from posttrain.engines import train_engine
    return train_engine("torch", path, role, lr=lr), train_engine("megatron", path, role, lr=lr)


def equals_transformers(path) -> dict[str, torch.Tensor]:
    """Assert the megatron engine's logits on `path` equal transformers' (fp32, within `forward_tol`) and its export
    is the checkpoint's state bit for bit; that state."""
    from posttrain.models.preset import load_checkpoint
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    hf, _ = load_checkpoint(path)
    engine = MegatronTrainEngine(path, "reference")
    samples = _samples(hf.config.vocab_size)
    with torch.no_grad():
        got = engine.forward(samples)
        for i, s in enumerate(samples):
            want = hf(torch.tensor([s.prompt_ids + s.ids])).logits[0, len(s.prompt_ids) - 1:-1]
            assert (got[i, :len(s.ids)] - want).abs().max().item() < forward_tol(want.abs().max().item(), hf.config)
    exported, own = engine.weights(), hf.state_dict()
    assert set(exported) == set(own) and all(torch.equal(exported[k], own[k]) for k in own)
    return own


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_equal_transformers_and_weights_round_trip_exactly(ckpts, arch):
    equals_transformers(ckpts[arch])


def test_policy_updates_equal_the_torch_engines(ckpts):
    """Log-probabilities and entropies at a temperature, the loss's update over three steps, the full-vocabulary
    reverse KL, and a critic's values: what the RL and OPD loops read from a train engine."""
    torch_engine, mega = _engines(ckpts["llama"])
    samples, vocab, config = _samples(mega.vocab_size), mega.vocab_size, mega.hf_config
    tokens = _tokens(samples)
    with threads(1):  # the torch engine at one thread, megatron at two: their reductions block otherwise
        want = torch_engine.logprobs(samples, 0.7)
    with threads(2):
        got = mega.logprobs(samples, 0.7)
    for a, b in zip(want, got):
        assert (a - b).abs().max().item() < forward_tol(a.abs().max().item(), config)
    norms, updates = [], Updates(mega)
    for engine, n in ((torch_engine, 1), (mega, 2)):
        engine.train()
        with threads(n):
            for _ in range(3):
                loss, _, _ = engine.logprob_loss(samples, 1.0, lambda lp, ent: -(lp.sum() + 0.1 * ent.sum()) / 10)
                engine.backward(loss)
                norms.append(engine.step(1.0))
    # step i's gradient norm: a backward pass's sums, after i - 1 updates' drift (`loss_tol`'s)
    assert all(abs(a - b) < math.sqrt(i) * forward_tol(a, config)
               for i, (a, b) in enumerate(zip(norms[:3], norms[3:]), 1))
    moved = mega.weights()
    own = torch_engine.model.state_dict()
    assert max((moved[k] - own[k]).abs().max().item() for k in own) < updates.tol(tokens)
    assert (moved["model.norm.weight"] - 1).abs().max() > 1e-3  # it trained

    g = torch.Generator().manual_seed(1)
    teacher = [torch.log_softmax(torch.randn(sum(s.gen_mask), vocab, generator=g), -1) for s in samples]
    weights = torch.rand(len(samples), 7, generator=g)
    (la, ka), (lb, kb) = (e.reverse_kl_loss(samples, teacher, 0.9, weights) for e in (torch_engine, mega))
    # after the three steps (`loss_tol`'s drift): each KL a sum over the vocabulary of the forward's outputs
    top = ka.abs().max().item()
    assert abs(la.item() - lb.item()) < math.sqrt(3) * forward_tol(la.item(), config) + sum_tol(la.item(), vocab) \
        and (ka - kb).abs().max().item() < math.sqrt(3) * forward_tol(top, config) + sum_tol(top, vocab)

    critics = _engines(ckpts["llama"], "critic")
    real = torch.tensor([[j < len(s.ids) for j in range(7)] for s in samples])
    updates = Updates(critics[1])
    for c, n in zip(critics, (1, 2)):
        c.train()
        with threads(n):
            c.backward(((c.forward(samples) - 1) ** 2 * real).sum())
            c.step(1.0)
    va, vb = (c.forward(samples) for c in critics)
    # a value: the head's row (moved by one update, `Updates`) over the hidden state (RMS-normed: |h_i| ~ 1)
    assert va.abs().max() > 0 and (va - vb)[real].abs().max().item() < \
        forward_tol(va.abs().max().item(), config) + updates.tol(tokens) * config.hidden_size


def test_sft_follows_the_torch_engines_loss_curve(ckpts, tok):
    """posttrain.train's loop over 20 steps, through the megatron engine and through transformers: one row of packed
    conversations (positions restart) and padded rows alternate, with the warmup + cosine schedule at train's own
    learning rate (not the one the engine was built with)."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.models.preset import load_checkpoint
    from posttrain.train import flat_examples, pad_examples, train
    rng = random.Random(0)
    data = [([rng.randrange(3, len(tok)) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2))
            for n in (rng.randrange(6, 20) for _ in range(6))]  # six conversations to learn by heart

    def batch(i):
        examples = rng.sample(data, 3)
        return (flat_examples if i % 2 else pad_examples)(examples, tok.pad_token_id, 64)
    batches = [batch(i) for i in range(20)]
    kw = dict(steps=20, lr=1e-2, warmup=3, desc="sft")
    model, _ = load_checkpoint(ckpts["llama"])
    with threads(1):
        want = train(TorchTrainEngine.for_lm(model, lr=1.0), lambda i: batches[i], **kw)["loss"]
    with threads(2):
        got = train(MegatronTrainEngine(ckpts["llama"], lr=1.0), lambda i: batches[i], **kw)["loss"]
    assert want[-1] < want[0] - 0.1  # it learned
    tokens = max(batch["input_ids"].numel() for batch in batches)
    assert max(abs(a - b) for a, b in zip(want, got)) < loss_tol(want, tokens, model.config)


def test_state_resumes_exactly(ckpts):
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    samples = _samples(300)

    def step(engine):
        engine.train()
        loss, _, _ = engine.logprob_loss(samples, 1.0, lambda lp, ent: -lp.sum() * torch.rand(()))  # needs the RNG
        engine.backward(loss)
        engine.step(1.0)

    a = MegatronTrainEngine(ckpts["llama"], lr=1e-2)
    step(a)
    state = torch.serialization.pickle.loads(torch.serialization.pickle.dumps(a.state_dict()))
    step(a)
    b = MegatronTrainEngine(ckpts["llama"], lr=1e-2)
    b.load_state_dict(state)
    step(b)
    wa, wb = a.weights(), b.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_recomputed_activations_give_the_same_update(ckpts):
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    samples, norms, weights = _samples(300), [], []
    for recompute in (False, True):
        engine = MegatronTrainEngine(ckpts["llama"], lr=1e-2, recompute=recompute)
        engine.train()
        loss, _, _ = engine.logprob_loss(samples, 1.0, lambda lp, ent: -lp.sum())
        engine.backward(loss)
        norms.append(engine.step(1.0))
        weights.append(engine.weights())
    assert norms[0] == norms[1] and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lm_batches(vocab: int) -> list[dict]:
    """sft's two batch forms: padded rows (21 tokens: not a multiple of the 2 x cp chunks) and packed documents."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 21), generator=g)
    mask = (torch.rand(2, 21, generator=g) > 0.3).long()
    docs = torch.tensor([list(range(9)) + list(range(12)), list(range(15)) + list(range(6))])
    return [{"input_ids": ids, "loss_mask": mask}, {"input_ids": ids, "loss_mask": mask, "position_ids": docs}]


STEP_TOKENS = 42  # the positions of `_samples` (2 x 21 of `_lm_batches`): what each of `_steps`' gradients sums over


def _steps(engine, samples: list, lm: bool) -> list[float]:
    """Four steps: RL-style on `samples` (this rank's share, in two micro-batches: posttrain.rl.step's call), or
    sft's LM loss on both batch forms twice (posttrain.train's call)."""
    losses = []
    engine.train()
    half = (len(samples) + 1) // 2
    parts = [(part, lambda lp, ent: -(lp.sum() + 0.1 * ent.sum()) / 4) for part in (samples[:half], samples[half:])
             if part]
    for i in range(4):
        if lm:
            loss = engine.forward_backward(_lm_batches(engine.vocab_size)[i % 2])
        else:
            loss = sum(loss for loss, _, _ in engine.logprob_losses(parts, 1.0))
        engine.step(1.0)
        losses.append(loss.detach())
    return losses


def _engine(path, par: dict):
    """A policy split as `par` says (Parallel's fields, `distributed_optimizer`, `micro_batches`, `train_indexers`,
    `mtp_weight` and `moe`)."""
    from posttrain.engines.megatron.layout import Parallel
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    par = dict(par)
    with steady_adam():  # as the one rank it is compared with
        return MegatronTrainEngine(path, lr=1e-3, distributed_optimizer=par.pop("distributed_optimizer", False),
                                   micro_batches=par.pop("micro_batches", 1), mtp_weight=par.pop("mtp_weight", 0.0),
                                   moe=par.pop("moe", None),
                                   train_indexers=par.pop("train_indexers", None), parallel=Parallel(**par))


def _rank(rank: int, world: int, port: int, par: dict, path: str, out: str, lm: bool, dense_max: int) -> None:
    """One rank of `world` running `_steps` (data-parallel ranks each take their share of the samples); rows longer
    than `dense_max` attend per document."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from posttrain.engines.megatron import forward as megatron_forward, pipeline_stages
    schedules = []  # the micro-batches of each 1F1B schedule run
    scheduled, dense = pipeline_stages.one_f_one_b, megatron_forward.DENSE_MASK_MAX
    megatron_forward.DENSE_MASK_MAX = dense_max
    pipeline_stages.one_f_one_b = lambda pipe, forward, m: schedules.append(m) or scheduled(pipe, forward, m)
    try:  # the process may run other ranks' jobs next (tests/gloo_pair.py)
        engine = _engine(path, par)
        shard, dp = engine.data_shard()
        losses = []
        for loss in _steps(engine, _samples(engine.vocab_size)[shard::dp], lm):
            if not lm:  # the whole batch's loss (the LM loss is the whole batch's on every rank already)
                dist.all_reduce(loss, group=ps.get_data_parallel_group())
            losses.append(loss.item())
        if par.get("pp"):  # a batch every stage refuses fails on each: none is left waiting for the last one's answer
            with pytest.raises(KeyError, match="loss_mask"):
                engine.lm_loss({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
        weights = engine.weights()
        owned = sum(p.numel() for g in engine.opt.param_groups for p in g["params"])  # the parameters this rank steps
        if rank == 0:
            torch.save({"losses": losses, "weights": weights, "schedules": schedules, "indexer": engine.indexer_stats,
                        "mtp": engine.mtp_stats, "moe": engine.moe_stats,
                        "owned": owned / sum(p.numel() for p in engine.model.parameters() if p.requires_grad)}, out)
    finally:
        pipeline_stages.one_f_one_b, megatron_forward.DENSE_MASK_MAX = scheduled, dense
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("par,lm,dense_max", [({"tp": 2}, False, 2048), ({}, False, 2048), ({"cp": 2}, True, 2048),
                                              ({"cp": 2}, False, 2048), ({"cp": 2}, True, 0), ({"pp": 2}, False, 2048),
                                              ({"pp": 2}, True, 2048),
                                              ({"pp": 2, "micro_batches": 2}, True, 2048),
                                              ({"distributed_optimizer": True}, False, 2048)],
                         ids=["tp2", "dp2", "cp2", "cp2-rl", "cp2-per-document", "pp2", "pp2-lm", "pp2-1f1b",
                              "dp2-distributed-optimizer"])
def test_two_gloo_ranks_give_one_ranks_losses_and_update(ckpts, tmp_path, gloo_pair, par, lm, dense_max):
    """Against one rank with its whole [T, T] masks; `cp2-rl`: the RL losses on the whole sequence gathered on both
    context-parallel ranks (the output weights' gradient shared, not doubled); `cp2-per-document`: the long rows'
    path, attention per document with no mask, over the two context-parallel ranks' query chunks; `pp2`: a layer on
    each pipeline stage, the tied embeddings on both ends (every stage returns the last stage's answer), RL's two
    micro-batches in the 1F1B order; `pp2-1f1b`: sft's batches in two micro-batches through the stages in the 1F1B
    order; `dp2-distributed-optimizer`: each rank steps about half the parameters, the update still the whole
    batch's."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    out = str(tmp_path / "rank0.pt")
    gloo_pair.spawn(_rank, (2, _free_port(), par, ckpts["llama"], out, lm, dense_max))
    got = torch.load(out)
    one = MegatronTrainEngine(ckpts["llama"], lr=1e-3)
    updates = Updates(one)
    with threads(2):  # the ranks run at one thread each
        want = [x.item() for x in _steps(one, _samples(one.vocab_size), lm)]
    assert max(abs(a - b) for a, b in zip(want, got["losses"])) < loss_tol(want, STEP_TOKENS, one.hf_config)
    w = one.weights()
    assert max((w[k] - got["weights"][k]).abs().max().item() for k in w) < updates.tol(STEP_TOKENS)
    if par.get("distributed_optimizer"):
        assert 0.3 < got["owned"] < 0.7
    else:
        assert got["owned"] == 1
    # over pipeline stages each step's two micro-batches go in the 1F1B order: RL's always, sft's as asked
    assert got["schedules"] == ([2] * 4 if par.get("micro_batches") or par.get("pp") and not lm else [])


def _critic_steps(engine) -> tuple[list[float], torch.Tensor]:
    """Three value-regression steps on `_samples` (the PPO critic's call: values, a masked squared error), and the
    value head's weight after them."""
    samples = _samples(engine.vocab_size)
    mask = torch.zeros(len(samples), max(len(s.ids) for s in samples))
    for i, s in enumerate(samples):
        mask[i, :len(s.ids)] = 1
    losses = []
    engine.train()
    for _ in range(3):
        v = engine.forward(samples)
        loss = ((v - 1.0) ** 2 * mask).sum() / mask.sum()
        engine.backward(loss)
        engine.step(1.0)
        losses.append(loss.item())
    return losses, engine.value_head.weight.detach().clone()


def _critic_rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from posttrain.engines.megatron.layout import Parallel
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    with steady_adam():
        engine = MegatronTrainEngine(path, "critic", lr=1e-2, parallel=Parallel(cp=2))
    got = _critic_steps(engine)
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


def test_a_critic_over_two_context_parallel_ranks_learns_as_one_rank(ckpts, tmp_path, gloo_pair):
    """Its values come from the whole sequence gathered on both ranks: the value head's gradient is shared between
    them, not counted twice."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    out = str(tmp_path / "critic.pt")
    gloo_pair.spawn(_critic_rank, (2, _free_port(), ckpts["llama"], out))
    losses, head = torch.load(out)
    one = MegatronTrainEngine(ckpts["llama"], "critic", lr=1e-2)
    updates = Updates(one)
    with threads(2):
        want, want_head = _critic_steps(one)
    assert want[-1] < want[0] and max(abs(a - b) for a, b in zip(want, losses)) < \
        loss_tol(want, STEP_TOKENS, one.hf_config)
    assert (head - want_head).abs().max().item() < updates.tol(STEP_TOKENS)


def test_attention_per_document_equals_the_whole_mask(ckpts, monkeypatch):
    """Long rows attend document by document (no [T, T] mask): the same losses and gradients as the mask on padded
    rows and on packed documents, one rank."""
    from posttrain.engines.megatron import forward as megatron_forward
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    got = []
    for dense_max, count in ((2048, 1), (0, 2)):  # at one thread and at two: their sums block otherwise
        monkeypatch.setattr(megatron_forward, "DENSE_MASK_MAX", dense_max)
        engine = MegatronTrainEngine(ckpts["llama"], lr=1e-3)
        engine.train()
        losses = []
        for batch in _lm_batches(engine.vocab_size):
            with threads(count):
                loss = engine.lm_loss(batch)
                engine.backward(loss)
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in engine.gpt.named_parameters() if p.grad is not None}
        got.append((losses, grads))
    (want, g0), (have, g1) = got
    assert max(abs(a - b) for a, b in zip(want, have)) < loss_tol(want, STEP_TOKENS, engine.hf_config)
    # each gradient element a backward pass's output summed over the batch's positions (`Updates`), over two batches
    largest, n = max(g.abs().max().item() for g in g0.values()), chain(engine.hf_config) + STEP_TOKENS
    assert max((g0[k] - g1[k]).abs().max().item() for k in g0) < math.sqrt(len(want)) * sum_tol(largest, n)


def test_layouts_and_models_it_cannot_split_fail_before_any_work(ckpts, tmp_path):
    from transformers import GPT2Config

    from posttrain.engines.megatron.layout import Parallel, check_layout
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    with pytest.raises(ValueError, match=r"megatron.tp: must divide the attention heads \(4\) and key-value heads "
                                         r"\(2\) \(got 3; supported: \[1, 2\]\)"):
        MegatronTrainEngine(ckpts["llama"], parallel=Parallel(tp=3))
    with pytest.raises(ValueError, match=r"no Megatron mapping for model_type 'gpt2' \(supported: llama, qwen2, "
                                         r"qwen3, glm_moe_dsa\)"):
        check_layout(GPT2Config(), Parallel())
    with pytest.raises(ConfigError) as e:
        load_config("smoke-dense", ["runtime.train_engine=megatron", "megatron.tp=3", "megatron.pp=2"])
    for rule in ("megatron.tp: must divide model.num_heads", "sft.workers: the megatron ranks",
                 "megatron.pp: must divide model.num_layers 1"):
        assert rule in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["runtime.train_engine=megatron", "megatron.ep=3", "megatron.tp=2",
                                  "moe.aux_loss_weight=0.001", "rl.routing_replay=true", "megatron.recompute=true"])
    for rule in ("megatron.ep: must divide model.n_routed_experts 8 (got 3)", "megatron.tp: Megatron splits a "
                 "mixture-of-experts model", "x ep = 6", "rl.routing_replay: not with megatron.recompute"):
        assert rule in str(e.value)
    with pytest.raises(ConfigError, match="megatron.ep: splits a mixture-of-experts model's experts"):
        load_config("smoke-dense", ["runtime.train_engine=megatron", "megatron.ep=2", "sft.workers=2"])
    with pytest.raises(ConfigError, match="ramp.attention: dsa on a dense model adds posttrain.s own indexers"):
        load_config("smoke-dense", ["runtime.train_engine=megatron", "ramp.attention=dsa", "ramp.dsa.top_k=32"])
    with pytest.raises(ConfigError, match="ramp.stages.0.rope_scaling: the megatron engine runs default RoPE"):
        load_config("smoke-dense", ["runtime.train_engine=megatron", "ramp.stages=[{seq_len: 96, tokens: 384, rope_theta: "
                              "20000.0, rope_scaling: {rope_type: yarn, factor: 2.0}}]"])


def test_a_ramp_stage_through_megatron_follows_the_torch_ramp(ckpts, tok):
    """One rung of the context ladder (its RoPE theta and length set, packed documents with restarting positions,
    long rows mixed in, a draft (MTP) layer installed at it) trained through the megatron engine: the torch path's
    loss and MTP curves, and the model that comes back carries the stage's RoPE and the trained draft layer."""
    from posttrain.stages import ramp
    from posttrain.models.preset import load_checkpoint
    from posttrain.packing import collate, pack
    rng = random.Random(1)
    docs = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(8, 40))] for _ in range(64)]
    short_val = collate(pack([(d, [1] * len(d)) for d in docs[:4]], 96), tok.pad_token_id)
    sets = ["ramp.stages=[{seq_len: 256, tokens: 6144, lr: 0.01, warmup: 2, rope_theta: 40000.0, long_share: 0.5}]",
            "ramp.batch_size=2", "ramp.long_docs=4", "mtp.depth=2"]
    got = {}
    for engine, n in (("torch", 1), ("megatron", 2)):
        cfg = load_config("smoke-dense", [*sets, f"runtime.train_engine={engine}"])
        model, _ = load_checkpoint(ckpts["llama"])
        torch.manual_seed(0)  # the same new draft layer
        with threads(n):
            got[engine] = ramp.train_stage(cfg, 0, cfg.ramp.stages[0], model, tok, docs, {}, short_val)
    (_, want), (model, child) = got["torch"], got["megatron"]
    loss, ref = child["history"]["loss"], want["history"]["loss"]
    tokens = cfg.ramp.batch_size * cfg.ramp.stages[0].seq_len
    assert len(loss) == 12 and ref[-1] < ref[0] - 0.4  # it learned (5.99 -> 5.50, the draft layer trained beside)
    assert max(abs(a - b) for a, b in zip(loss, ref)) < loss_tol(ref, tokens, model.config)
    mtp_loss, mtp_ref = child["history"]["mtp_loss"], want["history"]["mtp_loss"]
    assert len(mtp_loss) == 12 and max(abs(a - b) for a, b in zip(mtp_loss, mtp_ref)) < \
        loss_tol(mtp_ref, tokens, model.config)
    assert {"mtp_loss_first", "mtp_loss_last", "mtp_acc1_last"} <= set(child["metrics"])
    assert model.config.rope_parameters["rope_theta"] == 40000.0 and model.config.max_position_embeddings == 256
    val = want["metrics"]["short_val_loss"]  # after the 12 steps: as far apart as the last step's loss may be
    assert abs(child["metrics"]["short_val_loss"] - val) < \
        loss_tol([val] * 12, short_val["input_ids"].numel(), model.config)


def _rl_samples(vocab: int) -> list:
    """Two GRPO groups of two, different rewards within each group (so the update has advantages)."""
    from posttrain.rl.workers import Sample
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()
    out = []
    for group in range(2):
        prompt = ids(5)
        for reward, n in ((1.0, 4), (0.0, 6)):
            out.append(Sample("t", group, prompt, ids(n), [1] * n, [-1.5] * n, reward, 0))
    return out


@pytest.mark.parametrize("par", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_the_rl_trainer_over_two_model_parallel_ranks_updates_as_one_rank(ckpts, tmp_path, par):
    """RL and OPD with megatron.tp or pp > 1: the loop's trainer over two Ray actors gives one rank's step
    statistics and weights, two steps running, and what it saves resumes there (a one-rank file is refused)."""
    import ray

    from posttrain.config import RLConfig
    from posttrain.engines.megatron.layout import Parallel
    from posttrain.pipeline.raysupport import start_local
    from posttrain.rl.loop import build_engines
    r = RLConfig(group_size=2, lr=1e-3)
    build = dict(r=r, sft=str(ckpts["llama"]), with_critic=False, rl=False)
    one = build_engines(**build, engine=("megatron", {"parallel": Parallel()}))
    updates = Updates(one.policy)
    batch = _rl_samples(one.policy.vocab_size)
    tokens = _tokens(batch)
    with torch.no_grad():  # the behaviour is the policy itself: importance ratios of 1, nothing masked
        logp = one.policy.logprobs(batch, r.temperature)[0]
    for i, s in enumerate(batch):
        s.logprobs = logp[i, :len(s.ids)].tolist()
    with threads(2):  # the ranks at one thread each
        want = [one.update(r, batch, [], None) for _ in range(2)]

    def steady(eps=ADAM_EPS):  # `steady_adam` in the ranks' actors (self-contained: sent by value)
        import posttrain.engines.optim as T
        make = T.make_optimizer

        def made(*args, **kwargs):
            opt = make(*args, **kwargs)
            for group in opt.param_groups:
                group["eps"] = eps
            return opt
        T.make_optimizer = made
    start_local(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, configure_logging=False,
                runtime_env={"worker_process_setup_hook": steady})  # Ray's startup deadline retried on a busy machine
    try:
        with threads(1):
            two = build_engines(**build, engine=("megatron", {"parallel": Parallel(**par)}))
        got = [two.update(r, batch, [], None) for _ in range(2)]
        config = one.policy.hf_config
        for i, (a, b) in enumerate(zip(want, got), 1):  # the loss sums advantages x ratios: |A| = 2^-0.5, ratio 1
            assert a["grad_norm"] > 0 and abs(a["loss"] - b["loss"]) < loss_tol([1.0] * i, tokens, config)
            assert abs(a["grad_norm"] - b["grad_norm"]) < math.sqrt(i) * forward_tol(a["grad_norm"], config)
        w, v = one.policy.weights(), two.policy.weights()
        assert max((w[k] - v[k]).abs().max().item() for k in w) < updates.tol(tokens)
        two.save(tmp_path / "rl_state.pt", "state")
        after = two.update(r, batch, [], None)
        assert two.load(tmp_path / "rl_state.pt") == "state"
        assert abs(two.update(r, batch, [], None)["loss"] - after["loss"]) < 1e-6  # the same step again
        one.save(tmp_path / "one.pt", "state")
        with pytest.raises(ValueError, match="one.pt: a checkpoint of 1 trainer rank"):
            two.load(tmp_path / "one.pt")
        two.close()
    finally:
        ray.shutdown()


def _sharded_rank(rank: int, world: int, port: int, path: str, folder: str, out: str, par: dict) -> None:
    """Two LM steps over two ranks, a distributed checkpoint, then two more steps whose losses are saved."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    engine = _engine(path, par)
    _steps(engine, [], lm=True)
    engine.save_sharded(folder)
    losses = [x.item() for x in _steps(engine, [], lm=True)]
    if rank == 0:
        torch.save(losses, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("par", [{"tp": 2}, {"pp": 2}, {"distributed_optimizer": True}],
                         ids=["tp2", "pp2", "dp2-distributed-optimizer"])
def test_a_distributed_checkpoint_saved_over_two_ranks_resumes_on_one_rank(ckpts, tmp_path, gloo_pair, par):
    """Megatron's dist_checkpointing: weights and AdamW moments sharded over two tp ranks, split in two pipeline
    stages, or each data-parallel rank's moments for the parameters it steps, load into one rank (resharded on
    load), which then trains on as the two ranks did; a fresh engine alone does not."""
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    folder, out = tmp_path / "dist", str(tmp_path / "losses.pt")
    gloo_pair.spawn(_sharded_rank, (2, _free_port(), str(ckpts["llama"]), str(folder), out, par))
    assert (folder / "metadata.json").exists() and list(folder.glob("*.distcp"))
    want = torch.load(out)
    one = MegatronTrainEngine(ckpts["llama"], lr=1e-3)
    fresh = [x.item() for x in _steps(one, [], lm=True)]
    one = MegatronTrainEngine(ckpts["llama"], lr=1e-3)
    one.load_sharded(folder)
    with threads(2):  # the ranks ran at one thread each
        got = [x.item() for x in _steps(one, [], lm=True)]
    assert max(abs(a - b) for a, b in zip(got, want)) < loss_tol(want * 2, STEP_TOKENS, one.hf_config)  # steps 5-8
    assert max(abs(a - b) for a, b in zip(fresh, want)) > 1e-3  # the checkpoint carried the training
