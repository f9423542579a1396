"""curate on messy input: every bad-input kind ends in quarantine (with its reason) or a clear error
naming file and line, per `on_bad_row`; accounting always adds up; a failed gate publishes nothing."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain import data
from posttrain.stages import curate
from posttrain.config import load_config
from posttrain.curate.gates import GateFailed

GOOD = [{"id": f"g{i}", "text": f"The old road ran past a quiet field number {i} where birds sang.", "source": "web"}
        for i in range(40)]


def _cfg(*overrides):
    return load_config("smoke-dense", list(overrides))


def _write_jsonl(path, rows, extra_lines=()):
    with open(path, "wb") as f:
        for r in rows:
            f.write((json.dumps(r) + "\n").encode())
        for line in extra_lines:
            f.write(line)


def _run(cfg, raw, tmp_path):
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    return curate.run(cfg, {"raw": str(raw)}, out), out


BAD_LINES = {
    "malformed_json": b'{"id": "x", "text": "unterminated\n',
    "wrong_type": b'{"id": "y", "text": 42}\n',
    "not_an_object": b'["a", "list"]\n',
    "binary_garbage": bytes(b for b in range(256) if b != 10) + b"\n",
    "latin1_line": '{"id": "z", "text": "caf\xe9 cr\xe8me"}\n'.encode("latin-1"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_row_is_quarantined_or_fails_naming_file_and_line(kind, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _write_jsonl(raw / "corpus.jsonl", GOOD[:5], [BAD_LINES[kind]])
    res, out = _run(_cfg(), raw, tmp_path)
    q = pq.read_table(out / "quarantine.parquet").to_pylist()
    assert [r["id"] for r in q if r["reason"] == "bad_row"] == ["corpus.jsonl:6"]
    m = res["metrics"]
    assert m["rows_in"] == 6 == m["rows_kept"] + sum(v for k, v in m.items() if k.startswith("rejected_"))
    # the console says it too (execute prints each notice with the artifact's final place)
    assert any("quarantined" in n and "1 bad_row" in n and "{artifact}/quarantine.parquet" in n
               for n in res["notices"])
    with pytest.raises(curate.BadRow, match=r"corpus\.jsonl:6"):
        _run(_cfg("curate.on_bad_row=fail"), raw, tmp_path / "f")


def test_empty_file_and_huge_line(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "empty.jsonl").write_bytes(b"")
    _write_jsonl(raw / "big.jsonl.gz".replace(".gz", ""), GOOD + [{"id": "huge", "text": "word " * 10_000_000}])
    res, out = _run(_cfg(), raw, tmp_path)
    q = {r["id"]: r["reason"] for r in pq.read_table(out / "quarantine.parquet").to_pylist()}
    assert q["empty.jsonl:0"] == "empty_file" and q["huge"] == "too_long"
    with pytest.raises(curate.BadRow, match=r"empty\.jsonl.*empty"):
        _run(_cfg("curate.on_bad_row=fail"), raw, tmp_path / "f")


def test_parquet_and_gzip_inputs_with_field_mapping(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    rows = [{"doc_id": r["id"], "body": r["text"]} for r in GOOD]
    pq.write_table(pa.Table.from_pylist(rows[:20]), raw / "a.parquet")
    with gzip.open(raw / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[20:])
    res, _ = _run(_cfg("curate.text_field=body", "curate.id_field=doc_id"), raw, tmp_path)
    assert res["metrics"]["rows_in"] == 40 and res["metrics"]["rows_kept"] >= 2


def test_unmapped_text_field_fails_the_input_gate(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.Table.from_pylist([{"body": r["text"]} for r in GOOD]), raw / "a.parquet")
    with pytest.raises(curate.BadRow, match=r"a\.parquet.*'text'"):
        _run(_cfg("curate.on_bad_row=fail"), raw, tmp_path)
    with pytest.raises(GateFailed, match="(?s)gate .input.*column.: .text.*rows without a string 'text': a.parquet:1 "
                                         r"and 39 more rows: no column 'text' \(columns: body\)"):
        _run(_cfg(), raw, tmp_path / "q")


def _planted(raw):
    docs = {}
    for f in sorted(raw.glob("*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            docs.update((d["id"], d) for d in map(json.loads, fh))
    return docs


def test_generated_corpus_ground_truth_accounting_and_gates(tmp_path):
    cfg = _cfg("curate.raw_docs=2000")
    raw = tmp_path / "raw"
    raw.mkdir()
    planted = curate.make_raw(cfg, {}, raw)["metrics"]
    res, out = _run(cfg, raw, tmp_path)
    m = res["metrics"]
    assert m["rows_in"] == planted["planted_docs"]
    assert m["rows_in"] == m["rows_kept"] + sum(v for k, v in m.items() if k.startswith("rejected_"))
    docs = _planted(raw)
    reason = {r["id"]: r["reason"] for r in pq.read_table(out / "quarantine.parquet").to_pylist()}
    assert len(reason) == m["rows_in"] - m["rows_kept"]  # every rejected row is in quarantine
    by_kind = lambda k: [i for i, d in docs.items() if d["meta"]["planted"] == k]  # noqa: E731
    assert all(reason.get(i) == "contamination" for i in by_kind("contamination"))
    assert {reason.get(i) for i in by_kind("junk")} == {"low_alpha_ratio"}
    assert {reason.get(i) for i in by_kind("repetitive")} == {"repeated_ngrams"}
    assert {reason.get(i) for i in by_kind("boilerplate")} == {"boilerplate"}
    # a near-duplicate pair is resolved when exactly one of the two is dropped
    pairs = [(i, docs[i]["meta"]["dup_of"]) for i in by_kind("near_dup")]
    assert sum((a in reason) != (b in reason) for a, b in pairs) >= 0.95 * len(pairs)
    in_family = {i for a, b in pairs for i in (a, b)} | {i for i in by_kind("exact_dup")} | {
        docs[i]["meta"]["dup_of"] for i in by_kind("exact_dup")}
    assert not [i for i, r in reason.items() if r in ("near_dup", "exact_dup") and i not in in_family]
    assert m["mojibake_repaired"] >= planted["planted_mojibake"]
    validation = json.loads((out / "validation.json").read_text())
    suites = [v["suite"] for v in validation]
    assert suites[:2] == ["input corpus-00000.jsonl.gz", "input corpus-00001.jsonl.gz"]
    assert {"output ids", "splits"} <= set(suites) and all(v["success"] for v in validation)
    kept = [t for p in sorted(out.glob("pretrain-*.parquet")) for t in pq.read_table(p).column("text").to_pylist()]
    assert len(kept) == m["rows_kept"] and not any("@example.com" in t for t in kept)  # PII scrubbed
    card = json.loads((out / "data_card.json").read_text())
    assert card["rows_kept"] == m["rows_kept"] and card["sources"]["books"]["tokens"] > 0


def test_mojibake_repaired_and_mixture_weights(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    garbled = "The caf\u00e9 served cr\u00e8me br\u00fbl\u00e9e to a na\u00efve guest.".encode().decode("cp1252")
    rows = GOOD[:20] + [{"id": "moji", "text": garbled, "source": "books"}]
    _write_jsonl(raw / "a.jsonl", rows)
    res, out = _run(_cfg("curate.mixture={web: 2.0, books: 0.0}"), raw, tmp_path)
    kept = {r["id"]: r["text"] for r in pq.read_table(out / "pretrain-00000.parquet").to_pylist()}
    assert kept["moji"] == "The caf\u00e9 served cr\u00e8me br\u00fbl\u00e9e to a na\u00efve guest."
    texts = data.load_pretrain_texts(out)
    assert len(texts) == 2 * (len(kept) - 1) and kept["moji"] not in texts


def test_the_generated_corpus_is_byte_identical_run_to_run(tmp_path, monkeypatch):
    """Same seed, same bytes whenever it is written (gzip headers carry no write time): two runs share one raw
    artifact and its digest."""
    from posttrain.pipeline.artifacts import dir_digest
    for name, now in (("a", 1.0e9), ("b", 2.0e9)):
        monkeypatch.setattr(gzip.time, "time", lambda: now)
        (tmp_path / name).mkdir()
        curate.make_raw(_cfg(), {}, tmp_path / name)
    assert dir_digest(tmp_path / "a") == dir_digest(tmp_path / "b")


def test_blank_lines_are_skipped_and_a_file_of_them_is_refused_up_front(tmp_path):
    """Blank lines are not rows (their line numbers still count); a file holding only blank lines holds no row,
    and when every file is so the run stops before any work, naming the file."""
    from posttrain.cli import _check_local_inputs
    from posttrain.config import ConfigError
    from posttrain.curate.read import check_inputs
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n   \n\r\n")
    with pytest.raises(curate.BadRow, match=r"^curate\.inputs: every file is empty \(blank\.jsonl: no rows, only 3 "
                                            r"blank lines \(blank lines are skipped\)\)$"):
        check_inputs([str(blank)], "text")
    with pytest.raises(ConfigError, match=r"blank\.jsonl: no rows, only 3 blank lines"):
        _check_local_inputs(_cfg(f"curate.inputs=['{blank}']"))
    raw = tmp_path / "raw"
    raw.mkdir()
    _write_jsonl(raw / "a.jsonl", GOOD[:3], [b"\n", b"  \n", b'{"id": "y", "text": 42}\n'])
    (raw / "blank.jsonl").write_bytes(blank.read_bytes())
    assert check_inputs([str(raw / "*.jsonl")], "text") == [raw / "a.jsonl", raw / "blank.jsonl"]
    res, out = _run(_cfg(), raw, tmp_path)
    assert res["metrics"]["rows_in"] == 4  # three good rows and the bad one, no blank line
    q = {r["id"]: (r["reason"], r["detail"]) for r in pq.read_table(out / "quarantine.parquet").to_pylist()}
    assert q["a.jsonl:6"] == ("bad_row", "field 'text' is a JSON number (42), not a string")  # its own line number
    assert q["blank.jsonl:0"] == ("empty_file", "no rows, only 3 blank lines")
    assert json.loads((out / "data_card.json").read_text())["blank_lines_skipped"] == 5


def test_a_text_column_or_field_that_is_not_a_string_is_refused_up_front(tmp_path):
    from posttrain.curate.read import check_inputs
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": [1, 2]}), ints)
    with pytest.raises(curate.BadRow, match=r"^curate\.inputs: ints\.parquet: column 'text' is int64, not a string "
                                            r"column; curate reads the text from a string column"):
        check_inputs([str(ints)], "text")
    with pytest.raises(curate.BadRow, match=r"ints\.parquet has no column 'body'.*\(columns: id string, text int64\)"):
        check_inputs([str(ints)], "body")
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None, None]}), nulls)
    with pytest.raises(curate.BadRow, match=r"nulls\.parquet: column 'text' is null in 2 of 3 rows"):
        check_inputs([str(nulls)], "text")
    for name, value in (("number", 42), ("array", ["a", "list"]), ("null", None)):
        path = tmp_path / f"{name}.jsonl"
        _write_jsonl(path, [{"id": "x", "text": value}, {"id": "y", "text": value}])
        with pytest.raises(curate.BadRow, match=rf"^curate\.inputs: {name}\.jsonl: 2 of 2 rows have no string 'text', "
                                                rf"e\.g\. {name}\.jsonl:1: field 'text' is (a JSON )?{name}"):
            check_inputs([str(path)], "text")
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as f:  # gzip alike
        f.write(json.dumps({"body": "a document"}) + "\n")
    with pytest.raises(curate.BadRow, match=r"g\.jsonl\.gz: 1 of 1 rows have no string 'text', e\.g\. g\.jsonl\.gz:1: "
                                            r"no field 'text' \(fields: body\)"):
        check_inputs([str(tmp_path / "g.jsonl.gz")], "text")
    assert check_inputs([str(tmp_path / "g.jsonl.gz")], "body")  # mapped: fine
    # a few bad rows among good ones are curate's to quarantine (or refuse, curate.on_bad_row=fail): not refused
    _write_jsonl(tmp_path / "mixed.jsonl", GOOD[:3] + [{"id": "z", "text": 7}])
    assert check_inputs([str(tmp_path / "mixed.jsonl")], "text")
    # the raw node, the first of a run, refuses it too (it copies curate.inputs into the artifact)
    with pytest.raises(curate.BadRow, match=r"ints\.parquet: column 'text' is int64"):
        curate.make_raw(_cfg(f"curate.inputs=['{ints}']"), {}, tmp_path)


def test_a_byte_order_mark_costs_no_row(tmp_path):
    from posttrain.curate.read import check_inputs, read_rows
    from posttrain.replay import load_prompts
    rows = [{"id": "a", "text": "first row"}, {"id": "b", "text": "second row"}]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body)
    (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + body))
    for name in ("bom.jsonl", "bom.jsonl.gz"):
        assert list(read_rows(tmp_path / name, "text")) == [(1, rows[0], ""), (2, rows[1], "")]
        assert check_inputs([str(tmp_path / name)], "text")
    (tmp_path / "replay.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "Say hi."}\n')
    assert load_prompts(str(tmp_path / "replay.jsonl")) == ["Say hi."]
