import pytest

from posttrain.config import ConfigError, load_config


def test_profiles_load_and_overrides_change_the_digest():
    tiny = load_config("tiny")
    smoke = load_config("smoke")
    assert tiny.profile == "tiny" and smoke.profile == "smoke"
    changed = load_config("tiny", ["opd.steps=3", "rl.lr=1e-6"])
    assert changed.opd.steps == 3 and changed.rl.lr == 1e-6
    assert changed.digest() != tiny.digest()
    # sections a stage does not read keep their digest: the cache key of upstream stages is stable
    assert changed.digest("base", "ramp", "sft") == tiny.digest("base", "ramp", "sft")


def test_unknown_key_names_key_and_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rl:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"rl\.stepz: unknown key") as e:
        load_config(str(p))
    assert str(p) in str(e.value)


def test_wrong_type_and_bad_override_fail_before_work(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("base:\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"base\.steps"):
        load_config(str(p))
    with pytest.raises(ConfigError, match=r"sft\.nope: unknown key"):
        load_config("smoke-dense", ["sft.nope=1"])
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config("smoke-dense", ["justakey"])


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown profile 'huge'.*smoke"):
        load_config("huge")


# Ranges and cross-section rules: a bad value fails at load, naming its key and the rule, before any stage runs

def test_a_count_below_its_range_names_key_rule_and_value():
    with pytest.raises(ConfigError, match=r"eval\.samples: must be >= 0 \(got -1\)"):
        load_config("smoke-dense", ["eval.samples=-1"])
    with pytest.raises(ConfigError, match=r"base\.steps: must be >= 1 \(got 0\)"):
        load_config("smoke-dense", ["base.steps=0"])


def test_a_share_outside_0_1_is_refused():
    with pytest.raises(ConfigError, match=r"sft\.nothink_share: must be <= 1 \(got 1\.5\)"):
        load_config("smoke-dense", ["sft.nothink_share=1.5"])
    with pytest.raises(ConfigError, match=r"curate\.mixture\.web: must be >= 0"):
        load_config("smoke-dense", ["curate.mixture={web: -1}"])


def test_learning_rates_and_temperatures_must_be_positive():
    with pytest.raises(ConfigError, match=r"opd\.lr: must be > 0 \(got -0\.001\)"):
        load_config("smoke-dense", ["opd.lr=-0.001"])
    with pytest.raises(ConfigError, match=r"rl\.lr: must be > 0 \(got 0\.0\)"):
        load_config("smoke-dense", ["rl.lr=0"])  # RLConfig alone allows 0 (unit tests); an rl stage does not
    with pytest.raises(ConfigError, match=r"rl\.temperature: must be > 0"):
        load_config("smoke-dense", ["rl.temperature=0"])


def test_lengths_must_agree_across_sections():
    with pytest.raises(ConfigError, match=r"base\.seq_len: must be <= model\.max_position_embeddings \(got 128 > 64\)"):
        load_config("smoke-dense", ["base.seq_len=128"])
    with pytest.raises(ConfigError, match=r"ramp\.stages\.0\.seq_len: must be >= model\.max_position_embeddings"):
        load_config("smoke-dense", ["ramp.stages=[{seq_len: 32, tokens: 100000, rope_theta: 1.0e4}]"])
    with pytest.raises(ConfigError, match=r"quantize\.group_size: must divide model\.hidden_size"):
        load_config("smoke-dense", ["quantize.group_size=24"])
    with pytest.raises(ConfigError, match=r"model\.num_kv_heads: must divide model\.num_heads"):
        load_config("smoke-dense", ["model.num_kv_heads=3"])
    with pytest.raises(ConfigError, match=r"eval\.samples_on: \['ramped'\] are not chat-scored checkpoints"):
        load_config("smoke-dense", ["eval.samples_on=[sft, ramped]"])
    # a checkpoint brings its own shapes: the model section's rules on base and quantize do not apply
    assert load_config("smoke-dense", ["base.init_from=/some/ckpt", "base.seq_len=128"]).base.seq_len == 128


def test_per_domain_overrides_are_range_checked_with_their_key():
    with pytest.raises(ConfigError, match=r"rl\.per_domain\.agentic\.temperature: must be > 0 \(got 0\)"):
        load_config("smoke-dense", ["rl.per_domain.agentic.temperature=0"])
    with pytest.raises(ConfigError, match=r"rl\.per_domain\.agentic\.lr: must be > 0"):
        load_config("smoke-dense", ["rl.per_domain.agentic.lr=0"])
    with pytest.raises(ConfigError, match=r"rl\.per_domain\.general\.group_size must be at least 2 for grpo"):
        load_config("smoke-dense", ["rl.per_domain.general.group_size=1"])


def test_cli_refuses_an_unknown_stage_or_value_before_any_work(tmp_path, monkeypatch, capsys):
    from posttrain.cli import main
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    assert main(["run", "--profile", "smoke", "--force", "sft", "--force", "nosuchstage"]) == 2
    err = capsys.readouterr().err
    assert "--force: unknown stage 'nosuchstage'" in err and "stages: raw, curate, base" in err and "'sft'" not in err
    assert main(["run", "--profile", "smoke", "--set", "eval.samples=-1"]) == 2
    assert "eval.samples: must be >= 0 (got -1)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_lazy_teacher_share_per_domain():
    cfg = load_config("tiny", ["sft.shortcut_share={reasoning: 0.3}"])
    assert (cfg.sft.shortcut_for("reasoning"), cfg.sft.shortcut_for("general")) == (0.3, 0.0)
    assert load_config("smoke-dense", ["sft.shortcut_share=0.2"]).sft.shortcut_for("agentic") == 0.2
    from posttrain.pipeline.run import check_domains  # at the run's start (the config knows no environments)
    with pytest.raises(ConfigError, match=r"sft.shortcut_share: unknown domains \['maths'\]"):
        check_domains(load_config("smoke-dense", ["sft.shortcut_share={maths: 0.5}"]))
    check_domains(load_config("smoke-dense", ["sft.shortcut_share={counting: 0.5}", "world.environments={counting: m}"]))
    with pytest.raises(ConfigError, match=r"sft\.shortcut_share\.agentic: must be <= 1 \(got 1\.5\)\n?$"):
        load_config("smoke-dense", ["sft.shortcut_share={agentic: 1.5}"])  # the dict's error only, not the float's


def test_tracking_uri_from_the_profile_unless_the_environment_says(tmp_path, monkeypatch):
    import os

    from posttrain.pipeline import tracking
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "x")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # absent now, and restored as it was after the test
    assert tracking.tracking_uri(tmp_path).startswith("sqlite:///")
    cfg = load_config("smoke-dense", ["tracking.uri=http://mlflow.internal:5000"])
    assert cfg.digest() == load_config("smoke-dense").digest()  # where it is tracked does not change what it computes
    tracking.configure(cfg.tracking.uri)
    assert tracking.tracking_uri(tmp_path) == "http://mlflow.internal:5000" == os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:1")
    tracking.configure(cfg.tracking.uri)
    assert tracking.tracking_uri(tmp_path) == "http://env:1"
