"""LoRA adapters through the train engine (lora.rank > 0): only the adapters train, what leaves the engine is merged
under the model's own names, resume is exact, and the RL loop's rollouts and checkpoint see the merged policy."""
import pytest
import torch

import environments
from posttrain.config import ConfigError, ModelConfig, RLConfig, load_config
from posttrain.engines import lm_engine, lora_options, train_engine
from posttrain.engines.lora import Lora
from posttrain.models.preset import build_model, load_checkpoint, save_checkpoint
from posttrain.rl.loop import train_policy
from posttrain.rl.workers import RolloutWorker

SMALL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)


@pytest.fixture(scope="module")
def ckpt(tok, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lora-ckpt")
    save_checkpoint(build_model(SMALL, tok), tok, path)
    return str(path)


def _samples(ckpt):
    return RolloutWorker(ckpt).rollout(environments.get("reasoning").generate("train", 2, 0), 2, seed=0,
                                       temperature=1.0, max_new_tokens=6, max_turns=1)[0]


def _step(engine, samples):
    logits = engine.forward(samples)
    engine.backward(-logits.log_softmax(-1)[..., 3].mean())
    return engine.step(1.0)


def test_only_the_adapters_train_and_what_leaves_is_the_merged_model(ckpt):
    samples = _samples(ckpt)
    engine = train_engine("torch", ckpt, lr=1e-2, lora=Lora(rank=4, alpha=8.0))
    start = engine.weights()
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    trained = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    n_trained = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    assert n_trained < sum(p.numel() for p in frozen.values()) / 4
    for _ in range(3):
        _step(engine, samples)
    assert all(torch.equal(p, frozen[n]) for n, p in engine.model.named_parameters() if n in frozen)
    after = engine.weights()
    assert set(after) == set(start) and not any(".lora_" in k or "base_layer" in k for k in after)
    moved = [k for k in after if not torch.equal(after[k], start[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)  # the adapted linear layers, nothing else
    exported = engine.hf_model()
    assert type(exported) is type(engine.model) and set(exported.state_dict()) == set(start)
    assert all(torch.equal(exported.state_dict()[k], after[k]) for k in after)
    # W x + B A x against (W + B A) x, run in float64: they differ by the fp32 rounding of the merged weights
    # (2^-24 of each), a thousandth of what three steps learned at most
    x = torch.tensor([[1, 5, 7, 9, 4]])
    with torch.no_grad():
        a, b = engine.model.double()(x).logits, exported.double()(x).logits
    assert (a - b).abs().max() < 1e-3 * (a - build_model_logits(ckpt, x)).abs().max()


def build_model_logits(ckpt, x):
    model, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        return model.double()(x).logits


def test_on_glm5s_fused_experts_the_merged_weights_carry_the_experts_adapters(tok):
    """peft wraps GLM-5's fused routed experts' parameters themselves (gate_up_proj, down_proj), one wrapper inside the
    other: what leaves the engine for the rollout workers and the export is the adapted model, experts included."""
    from tests.test_glm5_model import GLM5
    from posttrain.engines.lora import attach, merged_weights
    torch.manual_seed(0)
    model = attach(build_model(ModelConfig(**GLM5), tok).eval(), Lora(rank=4, alpha=8.0))
    x = torch.tensor([[1, 5, 7, 9, 4, 3]])
    with torch.no_grad():
        base = model(x).logits  # peft starts B at zero: the base model's
    for n, p in model.named_parameters():
        if ".lora_B" in n:  # as trained adapters would be
            p.data.normal_(0, 0.1)
    assert any(n.endswith("mlp.experts.lora_B.default.weight") for n, _ in model.named_parameters())
    plain = build_model(ModelConfig(**GLM5), tok).eval()
    plain.load_state_dict(merged_weights(model), strict=True)
    with torch.no_grad():
        a, b = model(x).logits, plain(x).logits
    # fp32 (the experts' grouped matmul has no float64): the merge rounds each weight by 2^-24 of it, far below
    # what the adapters change
    assert (a - b).abs().max() < 1e-3 * (a - base).abs().max()


def test_adapter_training_resumes_exactly(ckpt):
    samples = _samples(ckpt)
    engine = train_engine("torch", ckpt, lr=1e-2, lora=Lora(rank=4, alpha=8.0))
    _step(engine, samples)
    state = torch.serialization.pickle.loads(torch.serialization.pickle.dumps(engine.state_dict()))
    _step(engine, samples)
    other = train_engine("torch", ckpt, lr=1e-2, lora=Lora(rank=4, alpha=8.0))
    other.load_state_dict(state)
    _step(other, samples)
    assert all(torch.equal(v, other.weights()[k]) for k, v in engine.weights().items())


def test_the_rl_loop_trains_adapters_and_returns_a_plain_merged_policy(ckpt):
    pool = environments.get("reasoning").generate("train", 8, 0)
    # an untrained policy earns no reward: the entropy bonus is what moves it
    r = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, val_every=0, stop_check=False, lr=1e-2,
                 entropy_coef=0.5)
    policy, _, st = train_policy(r, ckpt, pool, pool[:2], seed=0, engine=("torch", {"lora": Lora(4, 8.0)}))
    names = set(policy.state_dict())
    assert not any(".lora_" in k or "base_layer" in k for k in names)
    first, _ = load_checkpoint(ckpt)
    assert names == set(first.state_dict())
    assert any(not torch.equal(policy.state_dict()[k], v) for k, v in first.state_dict().items())
    assert len(st.history["loss"]) == 2


def test_lora_is_configured_per_stage_and_refused_where_the_engine_cannot(ckpt):
    cfg = load_config("smoke-dense", ["lora.rank=8", "lora.stages=[rl, opd]"])
    assert lora_options(cfg, "sft") == {} and lora_options(cfg, "rl")["lora"] == Lora(8, 32.0, "all-linear")
    assert lora_options(load_config("smoke-dense"), "rl") == {}
    model, tok = load_checkpoint(ckpt)  # sft's engine: adapters attached before Ray Train's DDP would wrap it
    engine = lm_engine(load_config("smoke-dense", ["lora.rank=4"]), model, tok, lr=1e-3, stage="sft")
    assert engine.lora and {n for n, p in model.named_parameters() if p.requires_grad} == \
        {n for n, _ in model.named_parameters() if ".lora_" in n}
    engine.close()
    with pytest.raises(ConfigError, match=r"lora\.rank: the megatron train engine trains no LoRA adapters \(torch"):
        load_config("smoke-dense", ["lora.rank=8", "runtime.train_engine=megatron"])
