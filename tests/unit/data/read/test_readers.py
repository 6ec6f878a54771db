"""Format readers on inputs users bring: JSON as datasets ship it, CSV edge cases, old line ends."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data.read.records import RecordChecker
from kiln.data.read.sources import iter_documents
from kiln.errors import DataError

DOCS = [f"doc {i}" for i in range(5)]


def read(path, **kw) -> list[str]:
    return [d.text for d in iter_documents(DataConfig(sources=[str(path)], **kw))]


def test_json_object_holding_the_records(tmp_path):
    recs = [{"text": t} for t in DOCS]
    (tmp_path / "a.json").write_text(json.dumps({"version": "1.0", "data": recs}))  # one line
    (tmp_path / "b.json").write_text(json.dumps({"data": recs, "version": "1.0"}, indent=2))
    (tmp_path / "c.json").write_text(json.dumps({"text": "one record", "tags": ["x", "y"]}, indent=2))
    assert read(tmp_path / "a.json") == DOCS
    assert read(tmp_path / "b.json") == DOCS
    assert read(tmp_path / "c.json") == ["one record"]  # has the field: a record, its arrays are not records
    docs = list(iter_documents(DataConfig(sources=[str(tmp_path / "b.json")])))
    assert [d.line for d in docs] == [3, 6, 9, 12, 15]  # each element's own line
    (tmp_path / "d.json").write_text(json.dumps({"train": recs, "test": recs}))
    with pytest.raises(DataError, match=r"d\.json: line 1: the object holds arrays under several keys \(train, test\)"):
        read(tmp_path / "d.json")


def test_json_object_larger_than_a_record_is_streamed(tmp_path, monkeypatch):
    from kiln.data.read import readers

    monkeypatch.setattr(readers, "CHUNK", 64)
    docs = [f"doc {i} ✓" for i in range(300)]
    (tmp_path / "a.json").write_text(json.dumps({"meta": {"n": 1}, "rows": [{"text": t} for t in docs]}))
    assert read(tmp_path / "a.json", max_record_bytes=200) == docs


def test_invalid_json_names_line_and_column_under_both_policies(tmp_path):
    (tmp_path / "a.json").write_text('[\n {"text": "ok"},\n {"text": "bad" "x"},\n {"text": "lost"}\n]')
    (tmp_path / "b.json").write_text(json.dumps([{"text": t} for t in DOCS])[:-15])  # truncated
    for policy in ("error", "skip"):
        with pytest.raises(DataError, match=r"a\.json: line 3 column 17: invalid JSON \(Expecting ','"):
            read(tmp_path / "a.json", on_bad_record=policy)  # skipping would drop the rest unseen
        with pytest.raises(DataError, match=r"b\.json: line 1 column \d+: .*truncated"):
            read(tmp_path / "b.json", on_bad_record=policy)


def test_json_single_object_and_bad_bytes(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"text": "whole file"}, indent=2))
    assert read(tmp_path / "a.json") == ["whole file"]
    (tmp_path / "b.json").write_bytes(b'[{"text": "ok"},\n{"text": "caf\xe9"},\n{"text": "fine"}]')
    with pytest.raises(DataError, match=r"b\.json:2: the record is not valid UTF-8 \(character 4: byte 0xE9"):
        read(tmp_path / "b.json")
    assert read(tmp_path / "b.json", on_bad_record="skip") == ["ok", "fine"]  # one record, not the file


def test_nested_field(tmp_path):
    rows = [{"meta": {"text": t}, "id": i} for i, t in enumerate(DOCS)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"meta.text": "literal"}\n')
    assert read(tmp_path / "a.jsonl", field="meta.text") == DOCS + ["literal"]
    (tmp_path / "b.jsonl").write_text('{"meta": {"title": "t"}}\n{"meta": "s"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:1: .*'meta\.text' is absent; 'meta' has: title"):
        read(tmp_path / "b.jsonl", field="meta.text")
    with pytest.raises(DataError, match=r"b\.jsonl:2: .*'meta' is a string, not an object"):
        list(iter_documents(DataConfig(sources=[str(tmp_path / "b.jsonl")], field="meta.text"), start=(0, 1)))
    pq.write_table(pa.table({"meta": [{"text": t, "n": 1} for t in DOCS]}), tmp_path / "c.parquet")
    assert read(tmp_path / "c.parquet", field="meta.text") == DOCS
    with pytest.raises(DataError, match=r"column 'meta' has no key 'body' \(its keys: (text, n|n, text)\)"):
        read(tmp_path / "c.parquet", field="meta.body")


def test_tsv_quotes_as_written_by_pandas_or_as_plain_text(tmp_path):
    import csv

    texts = ['"Hello," she said.', 'a tab\there and\na newline', 'say "hi" there']
    with open(tmp_path / "quoted.tsv", "w", newline="") as f:  # as pandas / Python's csv module write them
        w = csv.writer(f, dialect="excel-tab")
        w.writerows([["text", "id"], *[[t, i] for i, t in enumerate(texts)]])
    assert read(tmp_path / "quoted.tsv") == texts
    raw = ['"Hello," she said.', "say \"hi\" there", '"all quoted"']  # a corpus whose quotes are text
    (tmp_path / "raw.tsv").write_text("text\tid\n" + "".join(f"{t}\t{i}\n" for i, t in enumerate(raw)))
    assert read(tmp_path / "raw.tsv", csv_quoting=False) == raw
    assert read(tmp_path / "raw.tsv")[0] == "Hello, she said."  # what quoting does to them (docstring)



def test_csv_quote_that_never_closes_names_its_line_under_both_policies(tmp_path):
    """pyarrow reads a file that ends inside a quoted field without a word: the rest of the file was one
    field (one column) or one malformed row (several), and every row after the quote was lost."""
    (tmp_path / "a.csv").write_bytes(b'text\r\nok\r\n"say ""hi"" there"\r\n"never closed\r\nlost\r\nlost too\r\n')
    (tmp_path / "b.tsv").write_text('id\ttext\n1\tfine "here"\n2\t"a\ttab"\n3\t"open\n4\tlost\n')
    for policy in ("error", "skip"):  # skipping would drop the rest of the file unseen
        with pytest.raises(DataError, match=r"a\.csv: line 4: a quoted field opens here .* never closes"):
            read(tmp_path / "a.csv", on_bad_record=policy)
        with pytest.raises(DataError, match=r"b\.tsv: line 4: .* data\.csv_quoting=false"):
            read(tmp_path / "b.tsv", on_bad_record=policy)
    rest = "".join(f"{i}\trow {i}\n" for i in range(5, 250_000))  # longer than two read blocks (1 MiB)
    (tmp_path / "c.tsv").write_text('id\ttext\n1\tok\n2\t"open\n' + rest)
    # which is seen first, the block it overflows or the file's end, depends on how far pyarrow's thread read ahead
    with pytest.raises(DataError, match=r"c\.tsv: line 3: a quoted field .* (does not close within data\.max_rec|"
                                        r"never closes)"):
        read(tmp_path / "c.tsv", max_record_bytes=1000)
    (tmp_path / "d.csv").write_text('"te\nxt",id\nhello,1\n')  # the header's quote: rows were lost, no word said
    with pytest.raises(DataError, match=r"d\.csv: line 1: the header row opens a quoted field .* not close on its"):
        read(tmp_path / "d.csv", on_bad_record="skip")
    (tmp_path / "b.tsv").write_text('id\ttext\n1\tfine "here"\n2\t"a\ttab"\n3\t"closed\n"\n4\tkept\n')
    assert read(tmp_path / "b.tsv") == ['fine "here"', "a\ttab", "closed\n", "kept"]


def test_csv_header_only_and_fields_longer_than_a_block(tmp_path):
    (tmp_path / "a.csv").write_text("id,text\n")
    assert read(tmp_path / "a.csv", on_bad_record="skip") == []
    big = "x" * (3 << 20)  # longer than a read block
    (tmp_path / "b.csv").write_text(f"id,text\n1,small\n2,{big}\n3,after\n")
    assert read(tmp_path / "b.csv") == ["small", big, "after"]
    checker = RecordChecker("skip", max_record_bytes=1 << 20)
    cfg = DataConfig(sources=[str(tmp_path / "b.csv")], max_record_bytes=1 << 20)
    with pytest.raises(DataError, match=r"b\.csv: a row after row 1 is longer than data\.max_record_bytes"):
        list(iter_documents(cfg, checker=checker))
    (tmp_path / "c.csv").write_text("id,text\n1,small\n2," + "y" * 5000 + "\n3,after\n")
    cfg = DataConfig(sources=[str(tmp_path / "c.csv")], max_record_bytes=1000, on_bad_record="skip")
    checker = RecordChecker.from_config(cfg)
    assert [d.text for d in iter_documents(cfg, checker=checker)] == ["small", "after"]
    assert dict(checker.dropped) == {"too_long": 1}


@pytest.mark.parametrize("end", [b"\r\n", b"\r"])
def test_crlf_and_lone_cr_line_ends(tmp_path, monkeypatch, end):
    from kiln.data.read import readers

    monkeypatch.setattr(readers, "CHUNK", 3)  # a \r\n straddles read pieces
    (tmp_path / "a.txt").write_bytes(end.join([b"one", b"two", b"", b"three", b" ", b"four"]) + end)
    docs = list(iter_documents(DataConfig(sources=[str(tmp_path / "a.txt")], text_unit="line")))
    assert [(d.text, d.line) for d in docs] == [("one", 1), ("two", 2), ("three", 4), ("four", 6)]
    assert read(tmp_path / "a.txt", text_unit="paragraph") == ["one\ntwo", "three", "four"]


def test_csv_with_lone_cr_line_ends_and_a_header_csv_cannot_read(tmp_path):
    (tmp_path / "a.csv").write_bytes(b'id,text\r1,row one\r2,"quoted\rvalue"\r3,row three\r')  # old Mac line ends
    assert read(tmp_path / "a.csv") == ["row one", "quoted\rvalue", "row three"]
    (tmp_path / "b.csv").write_text("x" * 200_000 + ",text\n1,hello\n")  # longer than Python's csv field limit
    with pytest.raises(DataError, match=r"b\.csv: malformed CSV header row \(field larger than field limit"):
        read(tmp_path / "b.csv")


def test_a_file_of_another_encoding_or_kind_than_its_name_says_is_one_bad_file(tmp_path):
    """A UTF-16 file (as Windows PowerShell writes `>`) read line by line under on_bad_record=skip gave its
    lines as documents of NULs (UTF-16 ASCII is valid UTF-8); a parquet file named .jsonl, one 'not UTF-8'
    record per line of bytes."""
    (tmp_path / "a.txt").write_bytes("\ufeffhello there\r\nsecond line\r\n".encode("utf-16-le"))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "b.jsonl")
    (tmp_path / "c.txt").write_text("PAR1 is a word here\n")  # a text that begins as parquet does
    cfg = DataConfig(sources=[str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.txt")], text_unit="line",
                     on_bad_record="skip")
    checker = RecordChecker.from_config(cfg)
    assert [d.text for d in iter_documents(cfg, checker=checker)] == ["PAR1 is a word here"]
    assert dict(checker.dropped) == {"damaged_file": 2}
    with pytest.raises(DataError, match=r"a\.txt: the file is UTF-16 text .* Convert it \(iconv -f UTF-16"):
        read(tmp_path / "a.txt", text_unit="line")
    with pytest.raises(DataError, match=r"b\.jsonl: the file is a parquet file, not jsonl"):
        read(tmp_path / "b.jsonl")


def test_valid_json_that_pythons_json_module_cannot_decode(tmp_path):
    """Arrays nested deeper than the recursion limit, or an integer of over 4300 digits, raised RecursionError
    and ValueError tracebacks out of the .json reader (and RecursionError out of the .jsonl one)."""
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "a.jsonl").write_text(f'{{"text": "kept"}}\n{{"text": "x", "meta": {deep}}}\n{{"text": "too"}}\n')
    (tmp_path / "b.json").write_text(f'[{{"text": "x", "meta": {deep}}}]')
    (tmp_path / "c.json").write_text('[{"text": "x", "n": ' + "9" * 5000 + "}]")
    cfg = DataConfig(sources=[str(tmp_path / "a.jsonl")], on_bad_record="skip")
    checker = RecordChecker.from_config(cfg)
    assert [d.text for d in iter_documents(cfg, checker=checker)] == ["kept", "too"]
    assert dict(checker.dropped) == {"malformed": 1}
    with pytest.raises(DataError, match=r"a\.jsonl:2: .*cannot decode \(arrays or objects nested deeper"):
        read(tmp_path / "a.jsonl")
    with pytest.raises(DataError, match=r"b\.json: line 1 column 2: a JSON value Python's json module cannot decode"):
        read(tmp_path / "b.json", on_bad_record="skip")
    with pytest.raises(DataError, match=r"c\.json: line 1 column 2: .*\(Exceeds the limit \(4300 digits\)"):
        read(tmp_path / "c.json")


def test_json_lines_concatenated_from_files_with_a_byte_order_mark(tmp_path):
    """`cat a.jsonl b.jsonl` of files that each begin with a UTF-8 BOM: the line after the join was not valid
    JSON ('Expecting value: line 1 column 1'), a record lost under data.on_bad_record=skip."""
    one = b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n'
    (tmp_path / "a.jsonl").write_bytes(one + one.replace(b"first", b"third").replace(b"second", b"fourth"))
    assert read(tmp_path / "a.jsonl") == ["first", "second", "third", "fourth"]

