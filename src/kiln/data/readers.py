"""Format readers: one generator per file format, yielding raw records with their position.

Every reader takes a binary file object (already decompressed), streams it, and yields
`(index, line, value)` for each record, where `index` counts records from 0 (blank lines of text
and JSON Lines files are not records), `line` is the 1-based line where the record starts (None
for columnar formats), and `value` is what the record holds before validation: `bytes` (text,
CSV and binary columns, decoded later so a bad byte costs one record, not the file), any JSON
value, a `Missing` note when the record lacks the field, `TOO_LONG` when it is longer than `limit` bytes
(the rest is skipped without being held in memory), or a `Malformed` note (bad JSON).

`skip` records are passed over as cheaply as the format allows (parquet and arrow skip whole
batches), which is how a streaming reader resumes at a record.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Iterator
from typing import Any, BinaryIO

from kiln.errors import DataError

CHUNK = 1 << 20
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors write at the start of a file


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


TOO_LONG = _Marker("TOO_LONG")


class Malformed:
    """A record that cannot be parsed; `why` says what is wrong with it."""

    def __init__(self, why: str):
        self.why = why


class Missing(Malformed):
    """A record without the text field (or a file without the column)."""


class InvalidUTF8(Malformed):
    """A record whose bytes are not UTF-8."""


MISSING = Missing("the value is null")


Record = tuple[int, "int | None", Any]


def _readline(f: BinaryIO, limit: int) -> tuple[bytes | None, bool]:
    """One line of at most limit+1 bytes; (line, too_long). A longer line is consumed, not kept."""
    line = f.readline(limit + 1)
    if len(line) <= limit or line.endswith(b"\n"):
        return line, False
    while True:  # drain the rest of an over-long line in bounded pieces
        rest = f.readline(CHUNK)
        if not rest or rest.endswith(b"\n"):
            return line[:0], True


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, line, too_long) of every line, the first without a UTF-8 byte order mark."""
    lineno = 0
    while True:
        line, long_line = _readline(f, limit)
        if not line and not long_line:
            return
        lineno += 1
        yield lineno, line.removeprefix(BOM) if lineno == 1 else line, long_line


def read_text(f: BinaryIO, unit: str, limit: int, skip: int = 0) -> Iterator[Record]:
    """Plain text: the whole file, each non-blank line, or each blank-line-separated block."""
    if unit == "file":
        if skip:
            return
        data = f.read(limit + 1)
        yield 0, 1, TOO_LONG if len(data) > limit else data.removeprefix(BOM)
        return
    index, block, block_line, block_len, too_long = 0, [], 0, 0, False
    in_block = False
    for lineno, line, long_line in _lines(f, limit):
        blank = not long_line and not line.strip()
        if unit == "line":
            if blank:
                continue
            if index >= skip:
                yield index, lineno, TOO_LONG if long_line else line.rstrip(b"\r\n")
            index += 1
            continue
        if blank:  # paragraph mode: a blank line ends the block
            if in_block:
                if index >= skip:
                    yield index, block_line, TOO_LONG if too_long else b"".join(block).rstrip(b"\r\n")
                index += 1
            block, block_len, too_long, in_block = [], 0, False, False
            continue
        if not in_block:
            block_line, in_block = lineno, True
        block_len += len(line)
        if long_line or block_len > limit:
            too_long, block = True, []
        elif not too_long and index >= skip:
            block.append(line)
    if in_block and index >= skip:
        yield index, block_line, TOO_LONG if too_long else b"".join(block).rstrip(b"\r\n")


def _field(obj: Any, field: str) -> Any:
    if isinstance(obj, str):  # a bare JSON string is the document itself
        return obj
    if not isinstance(obj, dict):
        return Malformed(f"expected a JSON object with a '{field}' field, got {type(obj).__name__}")
    value = obj.get(field)
    if value is None:
        return Missing(f"'{field}' is {'null' if field in obj else 'absent'}; it has: {', '.join(list(obj)[:8])}")
    return value


_json_decode = json.JSONDecoder().decode


def read_jsonl(f: BinaryIO, field: str, limit: int, skip: int = 0) -> Iterator[Record]:
    """JSON Lines: one object per non-blank line; the record is its `field`."""
    index = 0
    for lineno, line, long_line in _lines(f, limit):
        if not long_line and not line.strip():
            continue
        if index >= skip:
            if long_line:
                yield index, lineno, TOO_LONG
            else:
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield index, lineno, InvalidUTF8(f"byte {e.start} of the line is not UTF-8")
                else:
                    try:
                        yield index, lineno, _field(_json_decode(text), field)
                    except ValueError as e:
                        yield index, lineno, Malformed(f"not valid JSON ({e})")
        index += 1


def read_json(f: BinaryIO, field: str, limit: int, skip: int = 0) -> Iterator[Record]:
    """A .json file: a top-level array of objects (streamed element by element), or JSON Lines."""
    head = f.read(CHUNK).removeprefix(BOM)
    start = head.lstrip()[:1]
    if start != b"[":
        yield from read_jsonl(io.BufferedReader(_Prefixed(head, f)), field, limit, skip)
        return
    yield from _read_json_array(head, f, field, limit, skip)


class _Prefixed(io.RawIOBase):
    """A raw stream that replays `head` and then reads on from `f`."""

    def __init__(self, head: bytes, f: BinaryIO):
        self.head, self.f = memoryview(head), f

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.head:
            n = min(len(b), len(self.head))
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.f.read(len(b))
        b[: len(data)] = data
        return len(data)


def _read_json_array(head: bytes, f: BinaryIO, field: str, limit: int, skip: int) -> Iterator[Record]:
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    index, eof, read = 0, False, len(head)
    try:
        buf = utf8.decode(head)
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except ValueError as e:
                if eof:
                    yield index, None, Malformed(f"element {index + 1} of the array is not valid JSON ({e.msg})")
                    return
                if len(buf) - pos > limit:
                    raise DataError(f"element {index + 1} of the JSON array is longer than "
                                    f"data.max_record_bytes={limit} bytes and cannot be skipped inside an "
                                    "array; raise the limit or convert the file to JSON Lines") from None
                more = f.read(CHUNK)
                eof, read = not more, read + len(more)
                buf = buf[pos:] + utf8.decode(more, final=eof)
                pos = 0
                continue
            if index >= skip:
                yield index, None, _field(obj, field)
            index += 1
            pos = end
    except UnicodeDecodeError:
        raise DataError(f"not valid UTF-8 (within the first {read} bytes, element {index + 1} of the array); "
                        "fix the file or convert it to UTF-8") from None


def read_parquet(f: BinaryIO, field: str, skip: int = 0) -> Iterator[Record]:
    """Parquet: the `field` column, read one row group batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if field not in names:
        yield from _missing_column(pf.metadata.num_rows, field, names, skip)
        return
    yield from _column_batches(pf.iter_batches(columns=[field], batch_size=1024), skip)


def read_arrow(f: BinaryIO, field: str, skip: int = 0) -> Iterator[Record]:
    """Arrow IPC (what Hugging Face `save_to_disk` writes): stream format, or file format."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(f)
        batches = iter(reader)
        names = reader.schema.names
    except pa.ArrowInvalid:
        f.seek(0)
        try:
            rf = pa.ipc.open_file(f)
        except pa.ArrowInvalid as e:
            raise DataError(f"not an Arrow IPC file ({e})") from None
        batches = (rf.get_batch(i) for i in range(rf.num_record_batches))
        names = rf.schema.names
    if field not in names:
        yield from _missing_column(sum(b.num_rows for b in batches), field, names, skip)
        return
    yield from _column_batches((b.select([field]) for b in batches), skip)


def read_csv(f: BinaryIO, field: str, delimiter: str, skip: int = 0) -> Iterator[Record]:
    """CSV/TSV with a header row: the `field` column, streamed in blocks; quoted newlines allowed.

    A row with the wrong number of columns is reported as malformed (with its line) and is not
    counted as a record.
    """
    import csv as pycsv

    import pyarrow as pa
    from pyarrow import csv

    header = f.readline().removeprefix(BOM)
    names = next(iter(pycsv.reader([header.decode("utf-8", "replace")], delimiter=delimiter)), None)
    if not names:
        return
    names = [n.strip() for n in names]
    bad: list[tuple[int | None, str]] = []

    def on_bad_row(row) -> str:
        line = row.number + 1 if row.number is not None else None  # +1: the header was read above
        bad.append((line, f"expected {row.expected_columns} columns, got {row.actual_columns}"))
        return "skip"

    parse = csv.ParseOptions(delimiter=delimiter, newlines_in_values=True, invalid_row_handler=on_bad_row)
    read = csv.ReadOptions(column_names=names, block_size=CHUNK, use_threads=False)
    if field not in names:
        rows = sum(b.num_rows for b in csv.open_csv(f, read_options=read, parse_options=parse))
        yield from _missing_column(rows, field, names, skip)
        return
    convert = csv.ConvertOptions(include_columns=[field], column_types={field: pa.binary()},
                                 strings_can_be_null=False, quoted_strings_can_be_null=False)
    try:
        index = 0
        for batch in csv.open_csv(f, read_options=read, parse_options=parse, convert_options=convert):
            if index >= skip:
                yield from ((-1, line, Malformed(why)) for line, why in bad)
            bad.clear()
            for record in _column_batches([batch], skip - index):
                yield record[0] + index, None, record[2]
            index += batch.num_rows
        for line, why in bad:
            yield -1, line, Malformed(why)
    except pa.ArrowInvalid as e:
        raise DataError(f"malformed CSV ({e}); fix the file or check data.format") from None


def _column_batches(batches, skip: int) -> Iterator[Record]:
    index, skip = 0, max(skip, 0)
    for batch in batches:
        n = batch.num_rows
        if index + n <= skip:
            index += n
            continue
        col = batch.column(0)
        values = col.to_pylist()
        for i in range(max(0, skip - index), n):
            v = values[i]
            yield index + i, None, MISSING if v is None else v
        index += n


def _missing_column(rows: int, field: str, names: list[str], skip: int) -> Iterator[Record]:
    missing = Missing(f"the file has no column '{field}' (it has: {', '.join(map(str, names))}); set data.field")
    for i in range(skip, rows):
        yield i, None, missing
