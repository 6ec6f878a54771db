"""A JSON text read piece by piece, for .json files larger than memory.

    s = JsonScanner(head, f, limit)     # `head`: the first bytes, already read from binary file `f`
    s.peek()                            # '[': the next character that is not white space
    for line, value in s.elements():    # each element of the array, decoded, with its 1-based line
        ...

Errors are DataErrors that say the line and column.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

from kiln.errors import DataError


class JsonScanner:
    """A JSON text read piece by piece: one value at a time is decoded, with at most about `limit`
    characters held, and the line (1-based) of each known. Bytes that are not UTF-8 become lone
    surrogates, so the record holding them is rejected (invalid_utf8), not the file."""

    TOO_BIG = object()  # what value() gives for a value longer than the limit, when asked
    _ws = re.compile(r"[ \t\r\n]*")

    def __init__(self, head: bytes, f: BinaryIO, limit: int, chunk: int = 1 << 20):
        self.f, self.limit, self.chunk, self.eof = f, limit, chunk, False
        self.utf8 = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf, self.pos = self.utf8.decode(head), 0
        self.line, self.mark = 1, 0  # the line at buf[mark]
        self.col0 = 0  # the column of buf[0] within its line, when the buffer starts mid-line
        self.decoder = json.JSONDecoder()
        self.start = 0  # where the value last decoded starts in buf

    def _more(self, want: int = 0) -> bool:
        """Read on (at least `want` bytes); what is before pos is dropped. False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(max(want, self.chunk))
        self.eof = not data
        self.line_at()
        gone = self.buf[:self.pos]
        nl = gone.rfind("\n")
        self.col0 = len(gone) - nl - 1 if nl >= 0 else self.col0 + len(gone)
        self.buf, self.pos, self.mark = self.buf[self.pos:] + self.utf8.decode(data, final=self.eof), 0, 0
        return True

    def line_at(self) -> int:
        """The line of the character at pos (positions only move forward)."""
        self.line += self.buf.count("\n", self.mark, self.pos)
        self.mark = self.pos
        return self.line

    def peek(self) -> str:
        """The next character that is not white space ('' at the end of the file), not consumed."""
        while True:
            self.pos = self._ws.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def value(self, whole: bool = True) -> Any:
        """The JSON value at pos, decoded; TOO_BIG (nothing consumed) if it is longer than `limit` and
        not `whole`, a DataError if `whole`."""
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # else a number may go on in the next piece
                    self.start, self.pos = self.pos, end
                    return obj
            except json.JSONDecodeError as e:
                cut = e.pos >= len(self.buf) - 8 or e.msg.startswith("Unterminated string")
                if self.eof or not cut:  # not for want of the next piece: the JSON is invalid
                    raise self._invalid(e) from None
            except (RecursionError, ValueError) as e:  # valid JSON that Python's json module does not decode
                raise self.error(f"a JSON value Python's json module cannot decode ({undecodable(e)}). A JSON file "
                                 "cannot be read on past it: convert the file to JSON Lines, where such a line is "
                                 "one bad record, skipped with data.on_bad_record=skip") from None
            if len(self.buf) - self.pos > self.limit:
                if not whole:
                    return self.TOO_BIG
                raise self.error(f"a JSON value is longer than data.max_record_bytes={self.limit} bytes and cannot "
                                 "be skipped inside a JSON text; raise the limit or convert the file to JSON Lines")
            self._more(len(self.buf) - self.pos)  # doubles the piece: a long value is not parsed anew per MB

    def elements(self) -> Iterator[tuple[int, Any]]:
        """(line, value) of each element of the array at pos."""
        self.pos += 1  # '['
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            self.peek()
            yield self.line_at(), self.value()
            c = self.peek()
            if c not in (",", "]"):
                raise self.error(f"invalid JSON (expected ',' or ']' after an array element, found {c!r})" if c
                                 else "the file ends inside a JSON array (truncated?)")
            self.pos += 1
            if c == "]":
                return

    def _invalid(self, e: json.JSONDecodeError) -> DataError:
        line = self.line - self.buf.count("\n", 0, self.mark) + e.lineno - 1  # e counts from buf[0]
        col = e.colno + (self.col0 if e.lineno == 1 else 0)
        ended = e.pos >= len(self.buf.rstrip()) or e.msg.startswith("Unterminated string")
        cut = ": the file ends inside it (truncated?)" if ended else ""
        return self.error(f"invalid JSON ({e.msg}{cut}). A JSON file cannot be read on past an error: fix the "
                          "file (python -m json.tool FILE shows where), or convert it to JSON Lines, where a bad "
                          "line is one record, skipped with data.on_bad_record=skip", line, col)

    def error(self, what: str, line: int | None = None, col: int | None = None) -> DataError:
        if line is None:
            line, nl = self.line_at(), self.buf.rfind("\n", 0, self.pos)
            col = self.pos - nl if nl >= 0 else self.col0 + self.pos + 1
        return DataError(f"line {line}" + (f" column {col}" if col is not None else "") + f": {what}")


def undecodable(e: Exception) -> str:
    """Why Python's json module raised `e` (not a JSONDecodeError) on valid JSON."""
    if isinstance(e, RecursionError):
        return "arrays or objects nested deeper than its recursion limit"
    return str(e).split(";")[0]  # 'Exceeds the limit (4300 digits) for integer string conversion: ...'

