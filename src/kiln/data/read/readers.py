"""Format readers of text, JSON Lines and JSON (table formats: `kiln.data.read.tables`): one generator per
file format, yielding raw records with their position.

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

import io
import json
from collections.abc import Iterator
from typing import Any, BinaryIO

from kiln.data.read.jsontext import JsonScanner, undecodable
from kiln.errors import DataError

CHUNK = 1 << 20
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors write at the start of a file


class DamagedFile(DataError):
    """A file that cannot be read (further): not the format it claims, truncated, corrupt. Under
    data.on_bad_record=skip the records read before the damage are kept and the file is counted."""


class NotItsFormat(DamagedFile):
    """A file whose first bytes say it is not what it is read as: UTF-16 or UTF-32 text (Windows tools write it),
    a parquet, Arrow, gzip, zstd or zip file under a text or JSON name. Read on, its bytes would be bad records
    one by one, or, under data.on_bad_record=skip, lines of garbage that happen to decode (UTF-16 ASCII is valid
    UTF-8 with a NUL after every character). `fix` says what to do."""

    def __init__(self, why: str, fix: str):
        super().__init__(why)
        self.fix = fix


# (first bytes, what the file is, whether it is text in another encoding); a match must also hold a byte no
# UTF-8 text begins with (0xFF, 0xFE, 0x8B, 0xB5) or, for PAR1 and ARROW1, a NUL soon after
_KINDS = [(b"\xff\xfe\x00\x00", "UTF-32", True), (b"\x00\x00\xfe\xff", "UTF-32", True),
          (b"\xff\xfe", "UTF-16", True), (b"\xfe\xff", "UTF-16", True),
          (b"\x1f\x8b", "gzip-compressed", False), (b"\x28\xb5\x2f\xfd", "zstd-compressed", False),
          (b"PAR1", "a parquet file", False), (b"ARROW1", "an Arrow IPC file", False),
          (b"PK\x03\x04", "a zip archive", False)]


def check_kind(head: bytes, url: str, fmt: str) -> None:
    """Raise NotItsFormat if `head`, the first bytes of a file read as `fmt` (text, jsonl, json, csv, tsv),
    shows that it is something else."""
    for magic, what, encoding in _KINDS:
        if not head.startswith(magic) or (magic[:1].isalpha() and b"\x00" not in head[:64]):
            continue
        name = url.rsplit("/", 1)[-1]
        if encoding:
            raise NotItsFormat(f"the file is {what} text (it begins with a {what} byte order mark), and Kiln reads "
                               "UTF-8", f"Convert it (iconv -f {what} -t UTF-8 {name} > {name}.utf8, then name that "
                               "file)")
        raise NotItsFormat(f"the file is {what}, not {fmt} as it is read (by its name or data.format)",
                           "Give it the name of what it is (.parquet, .arrow, .gz or .zst after its format; "
                           "unpack a zip) or set data.format")


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


class Null(Missing):
    """A record whose text field is there and null: counted as missing_field, said as null."""


class InvalidUTF8(Malformed):
    """A record whose bytes are not UTF-8."""


MISSING = Null("")  # a table's null value


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
    """Plain text: the whole file (its bytes as they are), each non-blank line, or each block of lines
    between blank ones (lines holding only spaces are blank). Lines end at \\n, \\r\\n or a lone \\r
    (Python's universal newlines); the lines of a block are joined with \\n."""
    if unit == "file":
        if skip:
            return
        data = f.read(limit + 1)
        yield 0, 1, TOO_LONG if len(data) > limit else data.removeprefix(BOM)
        return
    f = io.BufferedReader(_Newlines(f), buffer_size=CHUNK)
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


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


class _Newlines(io.RawIOBase):
    """A binary stream with each \\r\\n and lone \\r read as \\n, piece by piece. Pieces are taken with
    read1 (what one read of the source gives) where the source has it: a read of a whole CHUNK from a cut
    .gz or .zst raises at the damage and drops the up to 1 MiB it had decompressed before it, where the
    complete lines are that on_bad_record=skip keeps."""

    def __init__(self, f: BinaryIO):
        self.f, self.held, self.out = f, b"", memoryview(b"")
        self.read = getattr(f, "read1", f.read)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.out:
            data = self.read(CHUNK)
            at_end = not data
            data, self.held = self.held + data, b""
            if not data:
                return 0
            if data.endswith(b"\r") and not at_end:  # a \r\n may straddle two pieces: decide with the next
                data, self.held = data[:-1], b"\r"
            if b"\r" in data:
                data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            self.out = memoryview(data)
        n = min(len(b), len(self.out))
        b[:n] = self.out[:n]
        self.out = self.out[n:]
        return n


def _field(obj: Any, field: str) -> Any:
    """The record's text field; `field` may name a nested key with dots ('meta.text'), used when the
    record has no key with that literal name."""
    if isinstance(obj, str):  # a bare JSON string is the document itself
        return obj
    if not isinstance(obj, dict):
        return Malformed(f"expected a JSON object with a '{field}' field, got {json_type(obj)}")
    value, path = obj, []
    for key in [field] if field in obj or "." not in field else field.split("."):
        if not isinstance(value, dict):
            return Missing(f"'{field}' is absent: '{'.'.join(path)}' is {json_type(value)}, not an object")
        parent, value = value, value.get(key)
        if value is None:
            if key in parent:
                return Null(f"'{field}' is null")
            has = f"'{'.'.join(path)}' has" if path else "it has"
            return Missing(f"'{field}' is absent; {has}: {', '.join(list(parent)[:8])}")
        path.append(key)
    return value


_json_decode = json.JSONDecoder().decode


def read_jsonl(f: BinaryIO, field: str, limit: int, skip: int = 0) -> Iterator[Record]:
    """JSON Lines: one object per non-blank line; the record is its `field`. A line may begin with a UTF-8 byte
    order mark (files that each had one, concatenated)."""
    index = 0
    for lineno, line, long_line in _lines(f, limit):
        if line[:3] == BOM:
            line = line[3:]
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
                        value = _field(_json_decode(text), field)
                    except json.JSONDecodeError as e:
                        value = Malformed(f"not valid JSON ({e})")
                    except (RecursionError, ValueError) as e:
                        value = Malformed(f"JSON that Python's json module cannot decode ({undecodable(e)})")
                    yield index, lineno, value
        index += 1


def read_json(f: BinaryIO, field: str, limit: int, skip: int = 0) -> Iterator[Record]:
    """A .json file: a top-level array of records (streamed element by element); an object that holds
    the records in an array under one key (`{"version": 2, "data": [...]}`, as many datasets ship);
    a single object, which is one record; or JSON Lines saved as .json.

    An object is a record when it has `field` or holds no array; otherwise the elements of its one
    array are the records (an object with arrays under several keys is an error: which one holds the
    records is unclear). Invalid JSON is a DataError giving its line and column: a JSON text cannot be
    read on past an error, so the rest of the file would be lost, not skipped.
    """
    head = f.read(CHUNK).removeprefix(BOM)
    first, _, rest = head.lstrip().partition(b"\n")
    if first[:1] == b"{" and rest.strip()[:1] == b"{" and _one_value(first):  # JSON Lines in a .json file
        yield from read_jsonl(io.BufferedReader(_Prefixed(head, f)), field, limit, skip)
        return
    s, index = JsonScanner(head, f, limit, CHUNK), 0
    while c := s.peek():
        if c == "[":
            records = s.elements()
        elif c == "{":
            records = _object_records(s, field)
        else:
            records = iter([(s.line_at(), s.value())])
        for line, value in records:
            if index >= skip:
                yield index, line, _field(value, field)
            index += 1


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


def _one_value(line: bytes) -> bool:
    try:
        _json_decode(line.decode("utf-8", "surrogateescape"))
        return True
    except (ValueError, RecursionError):
        return False


def _object_records(s: JsonScanner, field: str) -> Iterator[tuple[int, Any]]:
    """(line, value) of the records of a top-level object: itself, or the elements of its array."""
    line = s.line_at()
    obj = s.value(whole=False)
    if obj is not JsonScanner.TOO_BIG:
        arrays = [k for k, v in obj.items() if isinstance(v, list)] if field not in obj else []
        if not arrays:
            yield line, obj
            return
        if len(arrays) > 1:
            raise s.error(f"the object holds arrays under several keys ({', '.join(arrays)}): "
                          "it is not clear which holds the records. Convert the file to JSON Lines (one "
                          "record per line) or to an array of records", line)
        s.pos = s.start  # read again, the records one by one, each with its line
    s.pos += 1  # '{'
    found = None  # the key of the records array
    while (c := s.peek()) != "}":
        key = s.value()
        if not isinstance(key, str) or s.peek() != ":":
            raise s.error("invalid JSON (expected a \"key\": value pair in the object)")
        s.pos += 1
        if s.peek() == "[" and key != field:
            if found is not None:
                raise s.error(f"the top-level object holds arrays under several keys ({found}, {key}): it is "
                              "not clear which holds the records. Convert the file to JSON Lines (one record "
                              "per line) or to an array of records")
            found = key
            yield from s.elements()
        elif key == field and found is None:
            raise s.error(f"the object is one record longer than data.max_record_bytes={s.limit} "
                          "bytes; raise the limit or convert the file to JSON Lines", line)
        else:
            s.value()  # metadata beside the records ("version": 2)
        if (c := s.peek()) not in (",", "}"):
            raise s.error(f"invalid JSON (expected ',' or '}}' after an object member, found {c!r})" if c else
                          "the file ends inside a JSON object (truncated?)")
        s.pos += c == ","
    s.pos += 1
