"""Reward-hacking alarms during RL: the rules, edge-triggering, and tags on the stage's MLflow run."""
import pytest
import torch

import environments
from posttrain.config import AlarmConfig, ModelConfig, RLConfig
from posttrain.rl import alarms


def _healthy(n: int = 12) -> dict:
    return {"kl_ref": [0.01 + 0.001 * i for i in range(n)], "entropy": [2.0 - 0.02 * i for i in range(n)],
            "reward": [0.3 + 0.01 * i for i in range(n)], "val_score": [(0, 0.3), (5, 0.35), (10, 0.4)]}


def _replay(hist: dict, a: AlarmConfig = AlarmConfig()) -> list[dict]:
    """Feed the curves step by step, as the loop does, and collect the alarms raised."""
    active, events = set(), []
    n = len(hist["reward"])
    for step in range(1, n + 1):
        seen = {k: v[:step] for k, v in hist.items() if k != "val_score"}
        seen["val_score"] = [p for p in hist["val_score"] if p[0] <= step]
        events += alarms.check(seen, a, active, step, "test", events)
    return events


def test_a_healthy_run_raises_nothing():
    assert _replay(_healthy()) == []


def test_kl_spike_fires_once_while_it_lasts_and_again_after_it_clears():
    h = _healthy(20)
    h["kl_ref"][6:9] = [0.8] * 3  # a sharp rise held for three steps
    h["kl_ref"][11] = 1.2  # one noisy batch: no alarm (the healthy default has such outliers for a step or two)
    h["kl_ref"][14:17] = [0.9] * 3
    events = _replay(h)
    assert [(e["kind"], e["step"]) for e in events] == [("kl_spike", 9), ("kl_spike", 17)]
    assert "median" in events[0]["message"]


def _flat_validation(h: dict) -> dict:
    h["val_score"] = [(0, 0.3), (5, 0.31), (10, 0.3)]
    return h


def test_entropy_collapse_without_learning():
    h = _flat_validation(_healthy())
    h["entropy"][9:] = [0.3] * 3
    assert [(e["kind"], e["step"]) for e in _replay(h)] == [("entropy_collapse", 10)]


def test_entropy_falling_while_validation_rises_is_a_policy_learning():
    h = _healthy()
    h["val_score"] = [(0, 0.3), (5, 0.5), (10, 0.6)]
    h["entropy"][6:] = [0.05] * 6  # a tenfold fall once validation rose, as the tiny default's specialists show
    assert _replay(h) == []


def test_reward_rising_while_validation_falls():
    h = _healthy()
    h["reward"] = [0.3] * 5 + [0.6] * 5 + [0.6, 0.6]
    h["val_score"] = [(0, 0.3), (5, 0.4), (10, 0.2)]
    events = _replay(h)
    assert [(e["kind"], e["step"]) for e in events] == [("reward_up_val_down", 10)]
    assert "0.400 -> 0.200" in events[0]["message"]


def test_each_kind_is_printed_once_per_stage_and_summarized_with_its_count(tmp_path, capsys):
    h = _healthy(20)
    h["kl_ref"][6:9] = [0.8] * 3  # two separate held rises: two events, one line while running, one in the summary
    h["kl_ref"][14:17] = [1.5] * 3
    events = _replay(h)
    assert [e["step"] for e in events] == [9, 17]
    live = capsys.readouterr().out
    assert live.count("ALARM kl_spike") == 1 and "at step 9" in live
    alarms.publish(events, tmp_path, "rl-test", h)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[rl-test] ALARM kl_spike: fired 2 times (steps 9, 17); kl_ref")
    assert "max 1.5" in line


def test_disabled_alarms_stay_quiet():
    h = _healthy()
    h["entropy"][9:] = [0.0] * 3
    assert _replay(h, AlarmConfig(enabled=False)) == []


def test_an_alarm_is_tagged_on_the_stage_run_as_it_fires(tmp_path, monkeypatch):
    from posttrain.pipeline import tracking
    home = str(tmp_path)
    run_id = tracking.start_run(home, "rl-agentic", {})
    monkeypatch.setenv(alarms.RUN_VAR, run_id)
    monkeypatch.setenv(alarms.HOME_VAR, home)
    h = _flat_validation(_healthy())
    h["entropy"][9:] = [0.3] * 3
    events = _replay(h)
    tags = tracking.client(home).get_run(run_id).data.tags
    assert tags[alarms.tag_name(events[0])] == events[0]["message"]
    assert alarms.tags(events)["alarms"] == "entropy_collapse"


@pytest.fixture(scope="module")
def ckpt(tok, tmp_path_factory):
    from posttrain.models.preset import build_model, save_checkpoint
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("policy")
    save_checkpoint(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                            max_position_embeddings=256), tok), tok, path)
    return str(path)


@pytest.mark.parametrize("watch", [True, False])
def test_kl_to_the_reference_is_watched_even_without_a_kl_loss(ckpt, watch, monkeypatch):
    """kl_coef 0: the reference still scores the batch for the KL alarm (unless turned off), and the update is the
    one without any KL term; alarms the rules raise reach the run's state."""
    from posttrain.rl.loop import train_policy
    monkeypatch.setattr(alarms, "conditions", lambda hist, a: {"entropy_collapse": (0.0, "forced")})
    tasks = environments.get("reasoning").generate("train", 8, 0)
    r = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, val_every=0, max_staleness=0,
                 alarms=AlarmConfig(reference_kl=watch), stop_check=False)  # untrained weights never stop
    _, _, st = train_policy(r, ckpt, tasks, tasks[:2], seed=0)
    assert ("kl_ref" in st.history) == watch
    assert [e["step"] for e in st.alarms] == [1]  # raised once: the condition never cleared
