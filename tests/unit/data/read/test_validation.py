"""Each kind of bad record under both policies, the length filters and exact-duplicate removal."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data.read.records import Deduplicator, RecordChecker
from kiln.data.read.sources import iter_documents
from kiln.errors import DataError


def jsonl(path, lines: list[bytes]):
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    return path


def good(t: str) -> bytes:
    return json.dumps({"text": t}).encode()


# (reason, file maker, expected origin in the message)
CASES = {
    "missing_field": (lambda p: jsonl(p / "a.jsonl", [good("ok"), b'{"title": "no text"}']), "a.jsonl:2"),
    "wrong_type": (lambda p: jsonl(p / "a.jsonl", [good("ok"), b'{"text": 42}']), "a.jsonl:2"),
    "invalid_utf8": (lambda p: jsonl(p / "a.jsonl", [good("ok"), b'{"text": "caf\xe9"}']), "a.jsonl:2"),
    "malformed": (lambda p: jsonl(p / "a.jsonl", [good("ok"), b'{"text": "unterminated']), "a.jsonl:2"),
    "empty": (lambda p: jsonl(p / "a.jsonl", [good("ok"), good("  \n ")]), "a.jsonl:2"),
    "too_long": (lambda p: jsonl(p / "a.jsonl", [good("ok"), good("x" * 5000)]), "a.jsonl:2"),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_bad_record_policies(tmp_path, reason):
    make, origin = CASES[reason]
    f = make(tmp_path)
    cfg = DataConfig(sources=[str(f)], max_record_bytes=1000)
    with pytest.raises(DataError) as e:
        list(iter_documents(cfg))
    msg = str(e.value)
    assert origin in msg and "data.on_bad_record=skip" in msg
    checker = RecordChecker.from_config(cfg.model_copy(update={"on_bad_record": "skip"}))
    docs = list(iter_documents(cfg, checker=checker))
    assert [d.text for d in docs] == ["ok"]
    assert dict(checker.dropped) == {reason: 1}
    assert checker.examples[reason] == [f"{f}:2"]


def test_bad_records_in_other_formats(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"fine\nbad \xff byte\n")
    (tmp_path / "b.csv").write_bytes(b"id,text\n1,ok\n2,\"two\",extra\n3,also ok\n")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": ["y", None]}), tmp_path / "d.parquet")
    cfg = DataConfig(sources=[str(tmp_path / "a.txt")], text_unit="line")
    with pytest.raises(DataError, match=r"a\.txt:2: the record is not valid UTF-8 \(byte 4"):
        list(iter_documents(cfg))
    with pytest.raises(DataError, match=r"b\.csv:3: the record cannot be parsed \(expected 2 columns, got 3\)"):
        list(iter_documents(cfg.model_copy(update={"sources": [str(tmp_path / "b.csv")]})))
    with pytest.raises(DataError, match=r"c\.parquet row 1: the record has no text field .*has: body.*data\.field"):
        list(iter_documents(cfg.model_copy(update={"sources": [str(tmp_path / "c.parquet")]})))
    with pytest.raises(DataError, match=r"d\.parquet row 2: the record has a null text field\. "):
        list(iter_documents(cfg.model_copy(update={"sources": [str(tmp_path / "d.parquet")]})))
    skip = cfg.model_copy(update={"on_bad_record": "skip", "sources": [str(tmp_path / "*")]})
    checker = RecordChecker.from_config(skip)
    assert [d.text for d in iter_documents(skip, checker=checker)] == ["fine", "ok", "also ok", "y"]
    assert dict(checker.dropped) == {"invalid_utf8": 1, "malformed": 1, "missing_field": 2}


def test_over_long_line_is_not_held_in_memory(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"short\n" + b"y" * (3 << 20) + b"\nafter\n")
    cfg = DataConfig(sources=[str(f)], text_unit="line", max_record_bytes=1024, on_bad_record="skip")
    checker = RecordChecker.from_config(cfg)
    docs = list(iter_documents(cfg, checker=checker))
    assert [(d.text, d.line) for d in docs] == [("short", 1), ("after", 3)]
    assert checker.dropped["too_long"] == 1


def test_length_filters_count_but_never_raise(tmp_path):
    f = jsonl(tmp_path / "a.jsonl", [good("a"), good("just right"), good("far too long for the filter")])
    cfg = DataConfig(sources=[str(f)], min_chars=3, max_chars=12)  # policy 'error': filters still only drop
    checker = RecordChecker.from_config(cfg)
    assert [d.text for d in iter_documents(cfg, checker=checker)] == ["just right"]
    assert dict(checker.dropped) == {"short": 1, "long": 1}


def test_deduplicator_beyond_its_merge_size(monkeypatch):
    monkeypatch.setattr(Deduplicator, "MERGE", 8)
    d = Deduplicator()
    first = [d.seen(h) for h in range(0, 100, 3)]
    again = [d.seen(h) for h in range(0, 100, 3)]
    assert not any(first) and all(again) and len(d) == 34
    assert d.sorted.size >= 32 and not d.seen(2**64 - 1) and d.seen(2**64 - 1)


def test_stdlib_is_lenient(tmp_path):
    """'@stdlib' skips its own few undecodable files instead of failing the quickstart."""
    from kiln.data.read.sources import SourceFile

    checker = RecordChecker("error")
    sf = SourceFile("x.py", "x.py", 3, "text", lenient=True)
    assert checker.check(b"\xff\xfe", sf, 0, 1) is None and checker.dropped["invalid_utf8"] == 1


def test_a_null_text_is_said_to_be_null_not_missing(tmp_path):
    """{"text": null} was reported as having "no text field ('text' is null; it has: text)"."""
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": null, "id": 2}\n{"meta": {"text": null}}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: the record has a null text field \('text' is null\)\. "):
        list(iter_documents(DataConfig(sources=[str(tmp_path / "a.jsonl")])))
    with pytest.raises(DataError, match=r"a\.jsonl:1: the record has no text field \('meta.text' is absent; "
                                        r"it has: text\)"):
        list(iter_documents(DataConfig(sources=[str(tmp_path / "a.jsonl")], field="meta.text")))


def test_a_record_too_long_suggests_splitting_only_a_whole_file(tmp_path):
    """A line over data.max_record_bytes, read with data.text_unit=line, was told to read big files by line."""
    (tmp_path / "a.txt").write_text("short\n" + "y" * 2000 + "\n")
    cfg = DataConfig(sources=[str(tmp_path / "a.txt")], max_record_bytes=1024)
    with pytest.raises(DataError, match=r"a\.txt:1: .*raise data\.max_record_bytes \(or read big text files with "
                                        r"data\.text_unit=line or paragraph\), or set"):
        list(iter_documents(cfg))
    with pytest.raises(DataError, match=r"a\.txt:2: .*raise data\.max_record_bytes, or set"):
        list(iter_documents(cfg.model_copy(update={"text_unit": "line"})))
