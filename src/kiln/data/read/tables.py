"""Readers of table formats: parquet, Arrow IPC (Hugging Face `save_to_disk`) and CSV/TSV.

Each yields `(index, line, value)` records as the readers in `kiln.data.read.readers` do (see there),
reading the `field` column one batch at a time; a dotted field ('meta.text') names a key inside a
struct column.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import BinaryIO

from kiln.data.read.readers import BOM, CHUNK, MISSING, DamagedFile, Malformed, Missing, Record, _Prefixed
from kiln.errors import DataError


def read_parquet(f: BinaryIO, field: str, skip: int = 0) -> Iterator[Record]:
    """Parquet: the `field` column, read one row group batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise DamagedFile(f"not a readable parquet file ({e})") from None
    try:
        column, keys, missing = _nested_column(pf.schema_arrow, field)
        if missing is not None:
            yield from _missing_column(pf.metadata.num_rows, missing, skip)
            return
        yield from _column_batches(pf.iter_batches(columns=[column], batch_size=1024), skip, keys)
    finally:
        pf.close()


def _nested_column(schema, field: str) -> tuple[str, list[str], str | None]:
    """(column, struct keys inside it, None) of `field`, or (.., .., why) when there is no such column.
    A dotted field ('meta.text') names a key of a struct column when no column has that literal name."""
    import pyarrow as pa

    names = schema.names
    if field in names or "." not in field or field.split(".")[0] not in names:
        why = None if field in names else f"the file has no column '{field}' (it has: {', '.join(map(str, names))})"
        return field, [], why
    column, *keys = field.split(".")
    t, path = schema.field(column).type, column
    for key in keys:
        if not pa.types.is_struct(t) or t.get_field_index(key) < 0:
            has = f"its keys: {', '.join(t.field(i).name for i in range(t.num_fields))}" \
                if pa.types.is_struct(t) else f"it is {t}, not a struct"
            return column, keys, f"the column '{path}' has no key '{key}' ({has})"
        t, path = t.field(key).type, f"{path}.{key}"
    return column, keys, None


def read_arrow(f: BinaryIO, field: str, skip: int = 0) -> Iterator[Record]:
    """Arrow IPC (what Hugging Face `save_to_disk` writes): stream format, or file format."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(f)
        batches = iter(reader)
    except pa.ArrowInvalid:
        f.seek(0)
        try:
            rf = pa.ipc.open_file(f)
        except pa.ArrowInvalid as e:
            raise DamagedFile(f"not an Arrow IPC file ({e})") from None
        batches = (rf.get_batch(i) for i in range(rf.num_record_batches))
        schema = rf.schema
    else:
        schema = reader.schema
    column, keys, missing = _nested_column(schema, field)
    if missing is not None:
        yield from _missing_column(sum(b.num_rows for b in batches), missing, skip)
        return
    yield from _column_batches((b.select([column]) for b in batches), skip, keys)


def read_csv(f: BinaryIO, field: str, delimiter: str, skip: int = 0, limit: int = 64 << 20,
             quoting: bool = True) -> Iterator[Record]:
    """CSV/TSV with a header row: the `field` column, streamed in blocks; quoted newlines allowed
    (with `quoting`; without it a quote is plain text and a row ends at each newline).

    A row with the wrong number of columns is reported as malformed (with its line) and is not
    counted as a record. A file of only a header has no records. Blocks hold a row of up to about
    `limit` bytes (a longer row cannot be passed over inside a CSV file: it is a DataError).
    """
    import csv as pycsv

    import pyarrow as pa
    from pyarrow import csv

    header, first = _header_line(f, limit)
    try:
        names = next(iter(pycsv.reader([header.decode("utf-8", "replace")], delimiter=delimiter,
                                       quoting=pycsv.QUOTE_MINIMAL if quoting else pycsv.QUOTE_NONE)), None)
    except pycsv.Error as e:
        raise DataError(f"malformed CSV header row ({e}); fix the file or check data.format") from None
    if quoting:
        head = _QuoteTracker(None, delimiter)
        head._feed(header)
        if head.state == head.QUOTED:  # pyarrow would read the rows below as the rest of the header's last name
            raise DataError("line 1: the header row opens a quoted field (with '\"') that does not close on its line; "
                            "name the columns without line breaks, or set data.csv_quoting=false if the "
                            "quotes in this file are plain text")
    first = first or f.read(1)
    if not names or not first:
        return
    quotes = _QuoteTracker(_Prefixed(first, f), delimiter) if quoting else None
    f = io.BufferedReader(quotes or _Prefixed(first, f), buffer_size=CHUNK)
    names = [n.strip() for n in names]
    bad: list[tuple[int | None, str]] = []

    def on_bad_row(row) -> str:
        line = row.number + 1 if row.number is not None else None  # +1: the header was read above
        bad.append((line, f"expected {row.expected_columns} columns, got {row.actual_columns}"))
        return "skip"

    parse = csv.ParseOptions(delimiter=delimiter, quote_char='"' if quoting else False, newlines_in_values=quoting,
                             invalid_row_handler=on_bad_row)
    block = min(max(CHUNK, limit + (1 << 16)), 1 << 30)  # a row may span two blocks, not three
    read = csv.ReadOptions(column_names=names, block_size=block, use_threads=False)
    index, reader = 0, None
    try:
        if field not in names:
            reader = csv.open_csv(f, read_options=read, parse_options=parse)
            rows = sum(b.num_rows for b in reader)
            _check_quotes(quotes)
            yield from _missing_column(rows, f"the file has no column '{field}' (it has: {', '.join(names)})", skip)
            yield from ((-1, line, Malformed(why)) for line, why in bad)  # counted too, not lost without a word
            return
        convert = csv.ConvertOptions(include_columns=[field], column_types={field: pa.binary()},
                                     strings_can_be_null=False, quoted_strings_can_be_null=False)
        reader = csv.open_csv(f, read_options=read, parse_options=parse, convert_options=convert)
        for batch in reader:
            _check_quotes(quotes)  # before the batch that holds the row a quote swallowed
            if index >= skip:
                yield from ((-1, line, Malformed(why)) for line, why in bad)
            bad.clear()
            for record in _column_batches([batch], skip - index):
                yield record[0] + index, None, record[2]
            index += batch.num_rows
        _check_quotes(quotes)
        for line, why in bad:
            yield -1, line, Malformed(why)
    except pa.ArrowInvalid as e:
        if "straddl" in str(e) and quotes is not None and quotes.state == quotes.QUOTED:
            raise DataError(f"line {quotes.open_line}: a quoted field opens here (with '\"') and does not close "
                            f"within data.max_record_bytes={limit} bytes: the quote may never close. Close it (a "
                            "quote inside a quoted field is written twice: \"\"), set data.csv_quoting=false if the "
                            "quotes in this file are plain text, or raise data.max_record_bytes if the field is "
                            "that long") from None
        if "straddl" in str(e):  # pyarrow's words for a row longer than a block
            raise DataError(f"a row after row {index} is longer than data.max_record_bytes={limit} bytes, "
                            "which a CSV file cannot skip; raise data.max_record_bytes (or look for an "
                            "unclosed quote there)") from None
        raise DataError(f"malformed CSV after row {index} ({e}); fix the file or check data.format") from None
    finally:
        if reader is not None:  # stops its reading thread now: one left running at exit aborts the interpreter
            reader.close()


class _QuoteTracker(io.RawIOBase):
    """A raw stream that passes `raw`'s bytes on and follows whether they end inside a quoted field, as
    pyarrow's CSV reader parses them: a '"' opens a quoted field only at the start of a field; inside one,
    '""' is a quote and a lone '"' closes it. pyarrow takes a file that ends inside a quoted field without
    a word, the rest of the file then being one field (or one malformed row), its rows lost; `unclosed`
    is then the line where that quote opened (the header is line 1)."""

    START, FIELD, QUOTED, QUOTE_END = range(4)

    def __init__(self, raw: io.RawIOBase, delimiter: str):
        self.raw, self.delim = raw, delimiter.encode()
        sep = rb"[" + re.escape(self.delim) + rb"\n\r]"
        self.separator = re.compile(sep)
        self.fields = re.compile(rb'(?:(?:[^"%s][^%s]*)?%s|"[^"]*(?:""[^"]*)*"(?!")[^%s]*%s)*'
                                 % (sep[1:-1], sep[1:-1], sep, sep[1:-1], sep))
        self.state, self.lines, self.open_line, self.cr = self.START, 1, 0, False  # lines: line ends read
        self.unclosed: int | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        if n:
            self._feed(bytes(b[:n]))
        elif len(b) and self.state == self.QUOTED:
            self.unclosed = self.open_line
        return n

    def _feed(self, data: bytes) -> None:
        opened, pos, n = None, 0, len(data)
        while pos < n:
            if self.state == self.QUOTE_END:
                if data[pos] == 34:  # '""': a quote inside the field
                    self.state, pos = self.QUOTED, pos + 1
                    continue
                self.state = self.FIELD  # closed: on to the field's end, as in an unquoted field
            if self.state == self.QUOTED:
                end = _QUOTED_BODY.match(data, pos).end()  # up to the next quote that is not '""'
                if end == n:
                    break
                self.state, pos = self.QUOTE_END, end + 1  # '"' closes, unless the next read begins with '"'
                continue
            if self.state == self.START:
                pos = self.fields.match(data, pos).end()  # whole fields, quoted or not, in one step
                if pos == n:
                    break
                if data[pos] == 34:  # a quoted field that does not close in `data`
                    opened, self.state, pos = pos, self.QUOTED, pos + 1
                    continue
                self.state = self.FIELD
            m = self.separator.search(data, pos)  # the end of this unquoted field (or of a quoted one's tail)
            if m is None:
                break
            self.state, pos = self.START, m.end()
        if self.state == self.QUOTED and opened is not None:  # a quote opened in `data` is still open
            self.open_line = self.lines + _line_ends(data[:opened]) + 1
        self.lines += _line_ends(data) - (self.cr and data[:1] == b"\n")  # a \r\n split between reads
        self.cr = data[-1:] == b"\r"


_QUOTED_BODY = re.compile(rb'[^"]*(?:""[^"]*)*')


def _line_ends(data: bytes) -> int:
    """Line ends in `data`: \n, \r\n or a lone \r."""
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")


def _check_quotes(quotes: _QuoteTracker | None) -> None:
    if quotes is not None and quotes.unclosed is not None:
        raise DataError(f"line {quotes.unclosed}: a quoted field opens here (with '\"') and never closes, so "
                        "the rest of the file would be read as one field and its rows lost. Close the quote (a "
                        "quote inside a quoted field is written twice: \"\"), or set data.csv_quoting=false if the "
                        "quotes in this file are plain text")


def _header_line(f: BinaryIO, limit: int) -> tuple[bytes, bytes]:
    """(the header row without its line end, the bytes read past it). A row ends at \\n, \\r\\n or a
    lone \\r (old Mac files, some spreadsheet exports), as the rows after it do for pyarrow's reader."""
    line = f.readline(limit).removeprefix(BOM)
    cr = line.find(b"\r")
    if cr < 0 or line[cr + 1:] == b"\n":
        return line.rstrip(b"\r\n"), b""
    return line[:cr], line[cr + 1:]


def _column_batches(batches, skip: int, keys: list[str] = ()) -> Iterator[Record]:
    import pyarrow.compute as pc

    index, skip = 0, max(skip, 0)
    for batch in batches:
        n = batch.num_rows
        if index + n <= skip:
            index += n
            continue
        col = batch.column(0)
        for key in keys:  # a key inside a struct column (null where the struct is null)
            col = pc.struct_field(col, key)
        values = col.to_pylist()
        for i in range(max(0, skip - index), n):
            v = values[i]
            yield index + i, None, MISSING if v is None else v
        index += n


def _missing_column(rows: int, why: str, skip: int) -> Iterator[Record]:
    missing = Missing(why)
    for i in range(skip, rows):
        yield i, None, missing
