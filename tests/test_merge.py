"""Model averaging with the base (posttrain/merge.py): the arithmetic, sharded checkpoints, tensors the base lacks,
and refusing checkpoints of another shape before anything is written."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.merge import average_with_base


def _write(folder, tensors, shards=None):
    folder.mkdir()
    if not shards:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(shards):
        f = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, folder / f, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, f)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_each_tensor_becomes_the_weighted_mean_and_a_tensor_the_base_lacks_stays(tmp_path):
    g = torch.Generator().manual_seed(0)
    trained = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
               "draft": torch.randn(2, generator=g)}
    base = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)}
    _write(tmp_path / "t", trained, shards=[["a"], ["b", "draft"]])
    _write(tmp_path / "b", base)
    assert average_with_base(tmp_path / "t", tmp_path / "b", 0.25) == {"averaged": 2, "kept": 1}
    out = load_file(tmp_path / "t" / "model-00001-of-00002.safetensors") | \
        load_file(tmp_path / "t" / "model-00002-of-00002.safetensors")
    for k in ("a", "b"):
        want = (0.75 * trained[k].double() + 0.25 * base[k].double()).to(trained[k].dtype)
        assert out[k].dtype == trained[k].dtype and torch.equal(out[k], want), k
    assert torch.equal(out["draft"], trained["draft"])


def test_weight_zero_keeps_the_trained_weights_and_one_gives_the_base(tmp_path):
    trained, base = {"a": torch.arange(6.0).reshape(2, 3)}, {"a": -torch.arange(6.0).reshape(2, 3)}
    _write(tmp_path / "t", trained)
    _write(tmp_path / "b", base)
    average_with_base(tmp_path / "t", tmp_path / "b", 0.0)
    assert torch.equal(load_file(tmp_path / "t" / "model.safetensors")["a"], trained["a"])
    average_with_base(tmp_path / "t", tmp_path / "b", 1.0)
    assert torch.equal(load_file(tmp_path / "t" / "model.safetensors")["a"], base["a"])


def test_only_the_tensors_the_pattern_names_are_averaged(tmp_path):
    trained = {"model.layers.0.mlp.w": torch.ones(2), "model.layers.0.attn.w": torch.ones(2)}
    _write(tmp_path / "t", trained)
    _write(tmp_path / "b", {k: torch.zeros(2) for k in trained})
    assert average_with_base(tmp_path / "t", tmp_path / "b", 0.5, only=r"\.mlp\.") == {"averaged": 1, "kept": 1}
    out = load_file(tmp_path / "t" / "model.safetensors")
    assert out["model.layers.0.mlp.w"].tolist() == [0.5, 0.5] and out["model.layers.0.attn.w"].tolist() == [1.0, 1.0]


def test_another_shape_is_refused_naming_the_tensor_and_nothing_is_written(tmp_path):
    _write(tmp_path / "t", {"embed": torch.ones(4, 2), "a": torch.ones(2)})
    _write(tmp_path / "b", {"embed": torch.zeros(5, 2), "a": torch.zeros(2)})
    before = (tmp_path / "t" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="different shapes.*embed"):
        average_with_base(tmp_path / "t", tmp_path / "b", 0.5)
    assert (tmp_path / "t" / "model.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="not in \\[0, 1\\]"):
        average_with_base(tmp_path / "t", tmp_path / "b", 1.5)
