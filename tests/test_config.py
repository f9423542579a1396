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
        load_config("smoke", ["sft.nope=1"])
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config("smoke", ["justakey"])


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown profile 'huge'.*smoke"):
        load_config("huge")
