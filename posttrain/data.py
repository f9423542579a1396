"""Reading the curated artifact: task splits and pretraining texts. Kept apart from posttrain.stages.curate (pandas,
datasketch, the dedup code) so the training and evaluation stages import only this."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.parquet as pq

from environments.base import Task


def hash64(text: str) -> int:
    """A stable 64-bit hash (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def load_tasks(folder: str | Path, name: str, domain: str) -> list:
    """One split (`sft`, `rl`, `val`, `test`) of one domain's tasks. RL prompts are tasks to solve: training data
    for SFT only (forms resumed as after a compaction, the guard judge's questions: environments.agentic) is left
    out of them."""
    table = pq.read_table(Path(folder) / f"{name}-{domain}.parquet")
    tasks = [Task.from_json(s) for s in table.column("task").to_pylist()]
    return [t for t in tasks if not t.meta.get("sft_only")] if name == "rl" else tasks


def load_pretrain_texts(folder: str | Path) -> list[str]:
    """Pretrain texts with the per-source mixture applied: weight 2 repeats a text, 0.5 keeps every other."""
    out = []
    for p in sorted(Path(folder).glob("pretrain-*.parquet")):
        t = pq.read_table(p, columns=["id", "text", "weight"])
        for rid, text, weight in zip(*(t.column(k).to_pylist() for k in ("id", "text", "weight"))):
            whole, frac = divmod(weight, 1.0)
            out += [text] * (int(whole) + (hash64(rid) / 2**64 < frac))
    return out
