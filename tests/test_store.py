"""The store never replaces what it published: of two runs computing one node the first publication wins and
the other takes it; a corrupted version is kept as evidence and the recomputed one goes beside it. Same rules for
a local folder and an S3 store (moto's server on loopback, conditional PUTs)."""
import json
import uuid

import pytest

from posttrain.pipeline.artifacts import read_with_timings, verify, write_manifest
from posttrain.pipeline.store import Store, local_versions, publish_local


def _staged(target, content: bytes):
    """A finished artifact in a staging folder beside `target`, as a stage leaves it before publishing."""
    tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(content)
    digest = write_manifest(tmp, stage="opd", parents={}, config_digest="c", code_digest="k", mlflow_run_id="r")
    return tmp, digest


def test_two_runs_publishing_one_node_share_the_first_publication(tmp_path):
    target = tmp_path / "artifacts" / "opd" / "0123456789abcdef"
    first, d1 = _staged(target, b"run one's weights")
    second, d2 = _staged(target, b"run two's weights")
    assert publish_local(first, target) == target
    assert publish_local(second, target) == target  # the later one takes the earlier one's artifact
    assert verify(target)["sha256"] == d1 != d2
    assert not second.exists() and not target.with_name(target.name + ".2").exists()


def test_a_corrupted_version_is_kept_and_the_new_one_published_beside_it(tmp_path):
    target = tmp_path / "artifacts" / "opd" / "0123456789abcdef"
    tmp, digest = _staged(target, b"weights" * 10)
    publish_local(tmp, target)
    weights = target / "model.safetensors"
    flipped = bytes([weights.read_bytes()[0] ^ 1]) + weights.read_bytes()[1:]
    weights.write_bytes(flipped)
    found = local_versions(target)
    assert found.valid is None and "model.safetensors" in found.corrupted[0]
    redo, new = _staged(target, b"weights" * 10)
    assert publish_local(redo, target, frozenset(found.seen)) == target.with_name(target.name + ".2")
    assert weights.read_bytes() == flipped  # the evidence stays
    again = local_versions(target)
    assert again.valid[0] == str(target.with_name(target.name + ".2")) and len(again.corrupted) == 1


@pytest.fixture
def s3_store(tmp_path, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="store")
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps one per set of arguments: an earlier test's server
    yield lambda name: Store("s3://store/home", tmp_path / name)
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_s3_store_commits_once_per_version_and_keeps_corrupted_ones(s3_store, tmp_path):
    one, two = s3_store("one"), s3_store("two")  # two machines, each with its own mirror
    a, da = _staged(tmp_path / "a" / "x", b"run one's weights")
    b, db = _staged(tmp_path / "b" / "x", b"run two's weights")
    key = "0123456789abcdef" * 4
    uri_a, sha_a = one.publish(a, "opd", key, da)
    uri_b, sha_b = two.publish(b, "opd", key, db)
    assert (uri_b, sha_b) == (uri_a, da)  # the conditional PUT refused the second commit: it took the first
    assert one.fs.glob(one._path(f"artifacts/opd/{key[:16]}/*/manifest.json")) == \
        [one._path(f"{one._rel(uri_a)}/manifest.json")]  # the loser's upload is gone
    # a manifest changed in the store: reported, kept, and the recomputed version committed beside it
    one.fs.pipe_file(one._path(f"{one._rel(uri_a)}/manifest.json"), b'{"stage": "opd"}')
    found = two.committed("opd", key)
    assert found.valid is None and "does not hash" in found.corrupted[0]
    uri_c, sha_c = two.publish(b, "opd", key, db, frozenset(found.seen))
    assert sha_c == db and uri_c != uri_a
    assert two.committed("opd", key).valid[0] == uri_c
    assert two.find_by_digest(db) == uri_c


def _staged_run(target, train_s: float):
    """A finished RL-like artifact whose history holds a wall-clock curve (different on every run)."""
    tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"the same weights")
    (tmp / "history.json").write_text(json.dumps({"reward": [0.5], "train_s": [train_s]}))
    return tmp, write_manifest(tmp, stage="rl-general", parents={}, config_digest="c", code_digest="k",
                               mlflow_run_id=str(train_s))


def test_a_forced_recompute_to_the_same_weights_keeps_the_digest(tmp_path):
    """--force on a node that trains to the same weights: a new version beside the old, with the old one's digest,
    so every node downstream (its cache key holds its inputs' digests) is served from the cache."""
    target = tmp_path / "artifacts" / "rl-general" / "0123456789abcdef"
    tmp, first = _staged_run(target, 0.25)
    publish_local(tmp, target)
    redo, again = _staged_run(target, 0.75)
    found = local_versions(target)
    assert publish_local(redo, target, frozenset(found.seen)) == target.with_name(target.name + ".2")
    assert again == first and local_versions(target).valid[1]["sha256"] == first
    assert read_with_timings(target.with_name(target.name + ".2"))["train_s"] == [0.75]


def test_an_s3_store_carries_the_timings_beside_the_digest(s3_store, tmp_path):
    one, two = s3_store("one"), s3_store("two")
    tmp, digest = _staged_run(tmp_path / "a" / "x", 0.5)
    uri, sha = one.publish(tmp, "rl-general", "0123456789abcdef" * 4, digest)
    local = two.fetch(uri, sha)  # another machine: downloaded and verified, timings.json included
    assert verify(local, digest)["timing_files"].keys() == {"timings.json"}
    assert read_with_timings(local) == {"reward": [0.5], "train_s": [0.5]}


def test_a_failed_runs_finished_stages_reach_another_machine_of_an_s3_store(s3_store, tmp_path, monkeypatch):
    """`posttrain rerun --from <failed run>` on a machine that did not run it: its config and partial.json travel."""
    from posttrain.pipeline import store
    s3_store("unused")  # the moto server and its bucket
    run_dir = tmp_path / "one" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text('{"profile": "smoke"}')
    (run_dir / "partial.json").write_text('{"failed": true, "stages": {"raw": {}}}')
    monkeypatch.setenv("POSTTRAIN_HOME", "s3://store/home")
    monkeypatch.setenv("POSTTRAIN_LOCAL", str(tmp_path / "one"))
    store.upload_failed_run(run_dir, "r1", "partial.json")
    monkeypatch.setenv("POSTTRAIN_LOCAL", str(tmp_path / "two"))
    store.download_run("r1")
    assert (tmp_path / "two" / "runs" / "r1" / "partial.json").read_text() == (run_dir / "partial.json").read_text()
    assert (tmp_path / "two" / "runs" / "r1" / "config.json").exists()
