"""Real checkpoints' shapes: bf16 weights, sharded safetensors with an index, tied embeddings; saved in the input's
dtype family; bad folders refused before any work, naming the folder and what is missing."""
import json
import os

import pytest
import torch
from chat_fixtures import make_checkpoint
from conftest import run_cli
from safetensors import safe_open

from posttrain.models.preset import CheckpointError, check_folder, load_checkpoint, save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bf16_sharded(tmp_path_factory):
    """A ChatML checkpoint written as bf16 in several shards with an index, as hub checkpoints come."""
    path = make_checkpoint("chatml", tmp_path_factory.mktemp("ckpt"))
    model, tok = load_checkpoint(path)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    for f in path.glob("model.safetensors"):  # the unsharded copy make_checkpoint wrote
        f.unlink()
    return path


def _dtypes(folder) -> set:
    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            out |= {st.get_tensor(k).dtype for k in st.keys()}
    return out


def test_bf16_sharded_in_bf16_sharded_out(bf16_sharded, tmp_path):
    assert (bf16_sharded / "model.safetensors.index.json").exists() and _dtypes(bf16_sharded) == {torch.bfloat16}
    check_folder(bf16_sharded)
    model, tok = load_checkpoint(bf16_sharded)
    assert next(model.parameters()).dtype == torch.float32  # trained in fp32 on CPU
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
    save_checkpoint(model, tok, tmp_path / "out", max_shard_size="20KB")
    out = tmp_path / "out"
    assert _dtypes(out) == {torch.bfloat16} and (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again, _ = load_checkpoint(out)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16)), k
    save_checkpoint(again, tok, tmp_path / "next")  # the chain keeps its family: bf16 again, one file now
    assert _dtypes(tmp_path / "next") == {torch.bfloat16}


@pytest.mark.parametrize("breakage,message", [
    (lambda p: (p / "tokenizer.json").unlink(), "missing a tokenizer"),
    (lambda p: (p / "config.json").unlink(), "missing config.json"),
    (lambda p: [f.unlink() for f in p.glob("*.safetensors")], r"missing weights"),
    (lambda p: _edit(p / "config.json", model_type="nosuchmodel"), "unknown architecture"),
    (lambda p: _edit(p / "config.json", vocab_size=999), "shapes do not match.*999"),
    (lambda p: (_edit(p / "tokenizer_config.json", chat_template=None), (p / "chat_template.jinja").unlink(missing_ok=True)),
     "no chat template"),
])
def test_bad_checkpoint_folders_fail_naming_the_folder(tmp_path, breakage, message):
    path = make_checkpoint("chatml", tmp_path / "ckpt")
    breakage(path)
    with pytest.raises(CheckpointError, match=f"{path}: {message}"):
        check_folder(path)


def _edit(path, **kv):
    data = json.loads(path.read_text())
    data.update(kv)
    path.write_text(json.dumps(data))


def test_cli_refuses_a_bad_init_from_before_any_work(tmp_path):
    path = make_checkpoint("chatml", tmp_path / "ckpt")
    (path / "tokenizer.json").unlink()
    p = run_cli(["run", "--profile", "smoke-dense", "--set", f"base.init_from={path}"], cwd=ROOT,
                env={"POSTTRAIN_HOME": str(tmp_path / "home")})
    assert p.returncode == 2 and f"base.init_from: {path}: missing a tokenizer" in p.stderr
    assert not (tmp_path / "home" / "runs").exists()  # nothing started
