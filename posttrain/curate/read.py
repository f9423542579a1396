"""Streaming reader for curate inputs: JSONL, JSONL.gz and Parquet, one row at a time, problems named by file:line."""
from __future__ import annotations

import glob
import gzip
import json
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


class BadRow(ValueError):
    """A row or file that curate cannot read; the message names file and line."""


def check_inputs(patterns: list[str]) -> list[Path]:
    """The files `curate.inputs` names, refused before any work when a pattern matches nothing, a file is not a
    supported format, or every file is empty."""
    files: set[Path] = set()
    for pattern in patterns:
        matched = [Path(f) for f in glob.glob(pattern) if Path(f).is_file()]
        if not matched:
            raise BadRow(f"curate.inputs: {pattern!r} matches no file")
        if bad := [f.name for f in matched if not f.name.endswith(DATA_SUFFIXES)]:
            raise BadRow(f"curate.inputs: {bad[0]} is not {', '.join(DATA_SUFFIXES)}")
        files.update(matched)
    if all(f.stat().st_size == 0 for f in files):
        raise BadRow(f"curate.inputs: every file is empty ({', '.join(sorted(f.name for f in files))})")
    return sorted(files)


def data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(DATA_SUFFIXES))


def read_rows(path: Path, text_field: str) -> Iterator[tuple[int, dict | None, str]]:
    """Yield (line or row number from 1, row or None, problem or "") for every row of one file.

    An empty file yields one (0, None, "empty_file"); it holds no row, so it is not counted in.
    """
    n = 0
    if path.name.endswith(".parquet"):
        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=4096)
            for batch in batches:
                for row in batch.to_pylist():
                    n += 1
                    ok = isinstance(row.get(text_field), str)
                    yield n, row, "" if ok else f"field {text_field!r} missing or not a string"
        except (pa.ArrowInvalid, OSError) as e:
            raise BadRow(f"{path.name}: not a readable Parquet file ({e})") from None
    else:
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    yield n, *_parse(raw, text_field)
        except (gzip.BadGzipFile, EOFError) as e:
            raise BadRow(f"{path.name}:{n + 1}: corrupt gzip stream ({e})") from None
    if n == 0:
        yield 0, None, "empty_file"


def _parse(raw: bytes, text_field: str) -> tuple[dict | None, str]:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 (binary or another encoding)"
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg}"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    if not isinstance(row.get(text_field), str):
        return row, f"field {text_field!r} missing or not a string"
    return row, ""
