import json

import pytest

from posttrain.pipeline.artifacts import DigestMismatch, atomic_dir, find_by_digest, read_with_timings, verify, write_manifest


def _artifact(root, name="a"):
    target = root / name
    with atomic_dir(target) as tmp:
        (tmp / "weights.bin").write_bytes(b"\x00\x01" * 100)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x.json").write_text("{}")
        digest = write_manifest(tmp, stage="s", parents={"up": "f" * 64}, config_digest="c", code_digest="k",
                                mlflow_run_id="r")
    return target, digest


def test_manifest_verifies_and_refuses_tampering(tmp_path):
    target, digest = _artifact(tmp_path)
    assert verify(target, digest)["files"].keys() == {"weights.bin", "sub/x.json"}
    (target / "weights.bin").write_bytes(b"tampered")
    with pytest.raises(DigestMismatch, match="weights.bin"):
        verify(target, digest)


def test_wrong_expected_digest_and_extra_file_are_refused(tmp_path):
    target, digest = _artifact(tmp_path)
    with pytest.raises(DigestMismatch, match="expected"):
        verify(target, "0" * 64)
    (target / "stray.txt").write_text("x")
    with pytest.raises(DigestMismatch, match="not in manifest"):
        verify(target, digest)


def test_atomic_dir_leaves_nothing_on_crash(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "half") as tmp:
            (tmp / "part.bin").write_bytes(b"x")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_find_by_digest(tmp_path):
    target, digest = _artifact(tmp_path)
    assert find_by_digest(tmp_path, digest) == target
    assert find_by_digest(tmp_path, "0" * 64) is None


def test_an_image_without_git_records_the_sha_it_was_built_with(monkeypatch):
    from posttrain.pipeline.artifacts import git_sha
    assert git_sha() != "0123abc"
    monkeypatch.setenv("POSTTRAIN_GIT_SHA", "0123abc")  # containers/*/Dockerfile: ARG GIT_SHA -> this
    assert git_sha() == "0123abc"


def _trained(folder, weights: bytes, hist: dict):
    """A stage's output as the RL stages leave it: weights and history.json, timings still in it."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "history.json").write_text(json.dumps(hist))
    return write_manifest(folder, stage="rl-reasoning", parents={"sft": "f" * 64}, config_digest="c",
                          code_digest="k", mlflow_run_id=str(folder))


def test_wall_clock_figures_stay_out_of_the_digest(tmp_path):
    """The same weights and curves with other timings (a rerun on a busier machine): the same digest, so nothing
    downstream is redone; the timings stay beside the history, checked but not hashed into the digest."""
    curves = {"reward": [0.1, 0.5], "val_score": [[0, 0.2], [2, 0.4]], "val_score/general": [[0, 0.3]],
              "student_tokens": [10, 20]}
    fast = {"train_s": [0.21, 0.19], "rollout_wait_s": [0.3, 0.2], "push_s": [0.01, 0.01], "wall_s": [0.6, 1.1],
            "val_wall_s": [[0, 0.0], [2, 1.3]], "gen_tokens_per_s": [900.0, 950.0], "train_tokens_per_s": [4e3, 5e3]}
    slow = {k: [[s, t * 3] if isinstance(t, list) else t * 3 for s, t in enumerate(v)] for k, v in fast.items()}
    d1 = _trained(tmp_path / "a", b"weights", {**curves, **fast})
    d2 = _trained(tmp_path / "b", b"weights", {**curves, **slow})
    assert d1 == d2
    assert json.loads((tmp_path / "a" / "history.json").read_text()) == curves  # what the training computed
    assert json.loads((tmp_path / "b" / "timings.json").read_text()) == slow
    assert read_with_timings(tmp_path / "b") == {**curves, **slow}  # as it trained, for readers of the timings
    m = verify(tmp_path / "a", d1)
    assert "timings.json" not in m["files"] and set(m["timing_files"]) == {"timings.json"}
    assert _trained(tmp_path / "c", b"weights", {**curves, "reward": [0.1, 0.6], **fast}) != d1  # a real change
    assert _trained(tmp_path / "d", b"other weights", {**curves, **fast}) != d1
    # checked all the same: a changed or missing timings file is refused like any other
    (tmp_path / "a" / "timings.json").write_text("{}")
    with pytest.raises(DigestMismatch, match="timings.json"):
        verify(tmp_path / "a", d1)
    (tmp_path / "a" / "timings.json").unlink()
    with pytest.raises(DigestMismatch, match="timings.json listed in manifest is missing"):
        verify(tmp_path / "a", d1)
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "timings.json").write_text("{}")  # not listed: refused as a stray file
    digest = write_manifest(tmp_path / "stray", stage="s", parents={}, config_digest="c", code_digest="k",
                            mlflow_run_id="r")
    (tmp_path / "stray" / "sub").mkdir()
    (tmp_path / "stray" / "sub" / "timings.json").write_text("{}")
    with pytest.raises(DigestMismatch, match="not in manifest"):
        verify(tmp_path / "stray", digest)


def test_an_rl_stage_run_twice_gives_byte_identical_weights_and_the_same_digest(tok, tmp_path):
    """A small synchronous RL run (rl.max_staleness=0), twice, written as rl.specialist writes its artifact: the
    weights are byte-identical, the timings differ, the digests are the same."""
    import torch

    import environments
    from posttrain.config import ModelConfig, RLConfig
    from posttrain.models.preset import build_model, save_checkpoint
    from posttrain.rl.loop import train_policy
    torch.manual_seed(0)
    ckpt = tmp_path / "policy"
    save_checkpoint(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                            max_position_embeddings=256), tok), tok, ckpt)
    tasks = environments.get("reasoning").generate("train", 16, 0)
    r = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, max_staleness=0, val_every=0,
                 lr=1e-3, stop_check=False)
    digests, timings = [], []
    for name in "ab":
        policy, _, st = train_policy(r, str(ckpt), tasks, tasks[:4], seed=0)
        out = tmp_path / name
        save_checkpoint(policy, tok, out)
        (out / "history.json").write_text(json.dumps(st.history))
        timings.append(st.history["train_s"])
        digests.append(write_manifest(out, stage="rl-reasoning", parents={}, config_digest="c", code_digest="k",
                                      mlflow_run_id=name))
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert timings[0] != timings[1]  # measured by a clock: never the same twice
    assert digests[0] == digests[1]
    assert "train_s" in read_with_timings(b) and "train_s" not in json.loads((b / "history.json").read_text())
