"""Model averaging with the model post-training started from: (1 - w) * trained + w * base, tensor by tensor.

Averaging the weights before and after post-training trades what it added against what it cost, without training
(Lin et al. 2023, "Mitigating the alignment tax of RLHF"; WiSE-FT, Wortsman et al. 2022). It works on the saved
safetensors files, so whatever trained them (full weights, merged LoRA adapters, any train engine) and however they
are sharded, the names are the ones both checkpoints were saved under. A tensor the base does not hold (a draft
layer added after it, as the tiny profile's MTP layer) stays the trained one's."""
from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _tensor_files(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (an index for sharded checkpoints, else every file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out |= dict.fromkeys(h.keys(), f)
    return out


def average_with_base(folder: str | Path, base: str | Path, w: float, only: str = "") -> dict[str, int]:
    """Rewrite the checkpoint in `folder` as (1 - w) * itself + w * `base` (computed in float64, stored in each
    tensor's own dtype); the counts of tensors averaged and kept. `only`: a regular expression; the tensors whose
    names it does not find stay as trained. Tensors of one name but different shapes (another architecture or
    vocabulary) fail before anything is written."""
    folder, base = Path(folder), Path(base)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"average_with_base: weight {w} is not in [0, 1]")
    ours, theirs = _tensor_files(folder), _tensor_files(base)
    if not ours:
        raise ValueError(f"average_with_base: {folder} holds no safetensors weights")
    with ExitStack() as stack:  # each file opened once (memory-mapped), not once per tensor
        handles = {f: stack.enter_context(safe_open(f, "pt")) for f in {*ours.values(), *theirs.values()}}
        shapes = {name: (a, b) for name in ours.keys() & theirs.keys()
                  if (a := handles[ours[name]].get_slice(name).get_shape())
                  != (b := handles[theirs[name]].get_slice(name).get_shape())}
        if shapes:
            raise ValueError(f"average_with_base: {folder} and {base} hold tensors of different shapes "
                             f"({dict(sorted(shapes.items())[:3])}): only one architecture and vocabulary can be "
                             f"averaged")
        counts = {"averaged": 0, "kept": 0}
        for f in sorted(set(ours.values())):
            tensors = load_file(f)
            for name, t in tensors.items():
                if name not in theirs or (only and not re.search(only, name)):
                    counts["kept"] += 1
                    continue
                b = handles[theirs[name]].get_tensor(name)
                tensors[name] = ((1 - w) * t.double() + w * b.double()).to(t.dtype)
                counts["averaged"] += 1
            tmp = f.with_name(f".{f.name}.tmp")
            save_file(tensors, tmp, metadata=handles[f].metadata())
            tmp.replace(f)
    return counts

