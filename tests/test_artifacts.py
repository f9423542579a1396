import pytest

from posttrain.artifacts import DigestMismatch, atomic_dir, find_by_digest, verify, write_manifest


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
    from posttrain.artifacts import git_sha
    assert git_sha() != "0123abc"
    monkeypatch.setenv("POSTTRAIN_GIT_SHA", "0123abc")  # containers/*/Dockerfile: ARG GIT_SHA -> this
    assert git_sha() == "0123abc"
