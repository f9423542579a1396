"""Streaming reader for curate inputs: JSONL, JSONL.gz and Parquet, one row at a time, problems named by file:line.

JSONL is read as UTF-8 with an optional byte-order mark (`utf-8-sig`: Windows tools write one), and blank lines
are skipped (counted, never rows): a file of blank lines holds no row."""
from __future__ import annotations

import glob
import gzip
import json
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
BLANK = "blank_line"  # read_rows' problem for a blank line: skipped, not a row
EMPTY = "empty_file"  # read_rows' problem for a file without a row
# what the up-front check reads of each JSONL file for the text field: enough to tell a mis-mapped or mistyped
# field (every row bad) from a few bad rows, which curate quarantines (curate.on_bad_row)
SAMPLE_ROWS = 1000
SAMPLE_CHARS = 8 << 20  # of text: whichever limit comes first


class BadRow(ValueError):
    """A row or file that curate cannot read; the message names file and line."""


def check_inputs(patterns: list[str], text_field: str | None = None) -> list[Path]:
    """The files `curate.inputs` names, refused before any work when a pattern matches nothing, a file is not a
    supported format, no file holds a row (empty, or only blank lines), or (with `text_field`) a file's text is not
    a string: a Parquet column of another type, or JSONL whose sampled rows mostly lack a string there (what
    curate's input gate would fail on, seconds into the node). A few bad rows among good ones are curate's to
    quarantine or refuse, per `curate.on_bad_row`."""
    files: set[Path] = set()
    for pattern in patterns:
        matched = [Path(f) for f in glob.glob(pattern) if Path(f).is_file()]
        if not matched:
            raise BadRow(f"curate.inputs: {pattern!r} matches no file")
        if bad := [f.name for f in matched if not f.name.endswith(DATA_SUFFIXES)]:
            raise BadRow(f"curate.inputs: {bad[0]} is not {', '.join(DATA_SUFFIXES)}")
        files.update(matched)
    empty = []
    for f in sorted(files):
        if f.stat().st_size == 0:
            empty.append(f.name)
        elif why := (_check_parquet if f.name.endswith(".parquet") else _check_jsonl)(f, text_field):
            empty.append(f"{f.name}: {why}")
    if len(empty) == len(files):
        raise BadRow(f"curate.inputs: every file is empty ({'; '.join(empty)})")
    return sorted(files)


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _check_parquet(path: Path, text_field: str | None) -> str:
    """"" when the file has rows, else why not; raises BadRow when its text column is missing, not strings, or
    mostly null (from the footer: nothing but metadata is read)."""
    try:
        with pq.ParquetFile(path) as f:
            meta, schema = f.metadata, f.schema_arrow
    except (pa.ArrowInvalid, OSError) as e:
        raise BadRow(f"curate.inputs: {path.name}: not a readable Parquet file ({e})") from None
    if meta.num_rows == 0:
        return "0 rows"
    if not text_field:
        return ""
    columns = ", ".join(f"{f.name} {f.type}" for f in schema)
    fix = f"set curate.text_field to the column that holds the text (columns: {columns})"
    if text_field not in schema.names:
        raise BadRow(f"curate.inputs: {path.name} has no column {text_field!r}: {fix}")
    kind = schema.field(text_field).type
    if not _is_text(kind):
        raise BadRow(f"curate.inputs: {path.name}: column {text_field!r} is {kind}, not a string column; curate "
                     f"reads the text from a string column (Arrow string or large_string): cast it to string or "
                     f"{fix}")
    nulls = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        col = next((group.column(j) for j in range(group.num_columns)
                    if group.column(j).path_in_schema == text_field), None)
        stats = col.statistics if col is not None else None
        if stats is None or not stats.has_null_count:
            return ""  # not recorded: curate's input gate judges
        nulls += stats.null_count
    if nulls * 2 > meta.num_rows:
        raise BadRow(f"curate.inputs: {path.name}: column {text_field!r} is null in {nulls} of {meta.num_rows} rows; "
                     f"curate needs text in at least half the rows (its input gate): {fix}")
    return ""


def _check_jsonl(path: Path, text_field: str | None) -> str:
    """"" when the file has a row, else why not; with `text_field`, reads up to SAMPLE_ROWS rows and raises BadRow
    when more than half of them have no string there, or an empty one (curate's input gate rules)."""
    blank = rows = empty_text = size = 0
    bad: list[str] = []
    gen = read_rows(path, text_field or "")
    try:
        for line, row, problem in gen:
            if problem == BLANK:
                blank += 1
                continue
            if problem == EMPTY:
                break
            rows += 1
            if not text_field:
                break
            if problem:
                bad.append(f"{path.name}:{line}: {problem}")
            else:
                empty_text += not row[text_field]
                size += len(row[text_field])
            if rows >= SAMPLE_ROWS or size >= SAMPLE_CHARS:
                break
    except BadRow as e:
        raise BadRow(f"curate.inputs: {e}") from None
    finally:
        gen.close()
    if not rows:
        return f"no rows, only {blank} blank line{'s' * (blank != 1)} (blank lines are skipped)"
    of = f"{rows} rows" if rows < SAMPLE_ROWS and size < SAMPLE_CHARS else f"the first {rows} rows"
    rule = (f"curate needs the text as a JSON string in at least half the rows (its input gate): fix the rows, or set "
            f"curate.text_field to the field that holds the text")
    if len(bad) * 2 > rows:
        raise BadRow(f"curate.inputs: {path.name}: {len(bad)} of {of} have no string {text_field!r}, e.g. "
                     f"{'; '.join(bad[:3])}. {rule}")
    if empty_text * 2 > rows - len(bad):
        raise BadRow(f"curate.inputs: {path.name}: {text_field!r} is an empty string in {empty_text} of {of}. {rule}")
    return ""


def data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(DATA_SUFFIXES))


def read_rows(path: Path, text_field: str) -> Iterator[tuple[int, dict | None, str]]:
    """Yield (line or row number from 1, row or None, problem or "") for every row of one file.

    A blank JSONL line yields (line, None, BLANK): not a row, the caller skips it. A file without a row (empty, or
    only blank lines) yields one (0, None, EMPTY) at its end; it holds no row, so it is not counted in.
    """
    n = rows = 0
    if path.name.endswith(".parquet"):
        try:
            with pq.ParquetFile(path) as f:
                schema = f.schema_arrow
                if text_field not in schema.names:
                    wrong = f"no column {text_field!r} (columns: {', '.join(schema.names)})"
                elif not _is_text(schema.field(text_field).type):
                    wrong = f"column {text_field!r} is {schema.field(text_field).type}, not a string column"
                else:
                    wrong = ""
                for batch in f.iter_batches(batch_size=4096):
                    for row in batch.to_pylist():
                        n += 1
                        ok = not wrong and isinstance(row.get(text_field), str)
                        yield n, row, "" if ok else wrong or f"column {text_field!r} is null"
        except (pa.ArrowInvalid, OSError) as e:
            raise BadRow(f"{path.name}: not a readable Parquet file ({e})") from None
        rows = n
    else:
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    row, problem = _parse(raw, text_field)
                    rows += problem != BLANK
                    yield n, row, problem
        except (gzip.BadGzipFile, EOFError) as e:
            raise BadRow(f"{path.name}:{n + 1}: corrupt gzip stream ({e})") from None
    if rows == 0:
        yield 0, None, EMPTY


def _parse(raw: bytes, text_field: str) -> tuple[dict | None, str]:
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark is not part of the row
    except UnicodeDecodeError:
        return None, "not UTF-8 (binary or another encoding)"
    if not text.strip():
        return None, BLANK
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg}"
    if not isinstance(row, dict):
        return None, f"a JSON {_kind(row)}, not an object"
    return row, text_problem(row, text_field)


def text_problem(row: dict, field: str) -> str:
    """"" when `row[field]` is a string, else what it is instead."""
    if field not in row:
        return f"no field {field!r} (fields: {', '.join(list(row)[:10])})"
    value = row[field]
    if isinstance(value, str):
        return ""
    if value is None:
        return f"field {field!r} is null, not a string"
    shown = json.dumps(value)
    return f"field {field!r} is a JSON {_kind(value)} ({shown[:40]}{'...' * (len(shown) > 40)}), not a string"


def _kind(value) -> str:
    return {bool: "boolean", int: "number", float: "number", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)
