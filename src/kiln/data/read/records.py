"""Record validation, length filters and exact-duplicate removal.

Validation turns a raw record into text or rejects it for a reason:

    missing_field  the record has no text field, or a null one (or the file no such column)
    wrong_type     the text field is not a string
    invalid_utf8   the bytes are not UTF-8 (or a JSON string holds a lone surrogate)
    malformed      the record cannot be parsed (bad JSON, wrong number of CSV columns)
    empty          the text is empty or only whitespace
    too_long       longer than data.max_record_bytes

With `data.on_bad_record: error` the first bad record raises a DataError naming its file and
line or row; with `skip` it is counted by reason (with the first few places as examples). The
filters (data.min_chars, data.max_chars, data.dedup) always drop and count: `short`, `long`,
`duplicate`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Protocol

import numpy as np

from kiln.data.read import readers
from kiln.errors import DataError


class Source(Protocol):
    """What a record check needs of the file it reads (kiln.data.read.sources.SourceFile)."""

    url: str  # as the user wrote it (or a file it expanded to): named in messages
    lenient: bool  # bad records are skipped whatever the policy
    named: bool  # named in data.sources itself (not found in a directory or by a glob)


REASONS = {
    "missing_field": "has no text field",
    "wrong_type": "has a text field that is not a string",
    "invalid_utf8": "is not valid UTF-8",
    "malformed": "cannot be parsed",
    "empty": "is empty or only whitespace",
    "too_long": "is longer than data.max_record_bytes",
    "short": "is shorter than data.min_chars (filter)",
    "long": "is longer than data.max_chars (filter)",
    "duplicate": "repeats an earlier document exactly (filter)",
    "damaged_file": "is a file that cannot be read to its end",
}
EXAMPLES = 3
NL = b"\n"


def where(source: str, index: int, line: int | None) -> str:
    """'file:line' for line-based formats, 'file row N' (1-based) for the others."""
    return f"{source}:{line}" if line is not None else f"{source} row {index + 1}"


class RecordChecker:
    """Validates raw records and applies the length filters; counts what it drops."""

    def __init__(self, policy: str = "error", max_record_bytes: int = 16 << 20, min_chars: int = 0,
                 max_chars: int | None = None):
        self.policy, self.limit = policy, max_record_bytes
        self.min_chars, self.max_chars = min_chars, max_chars
        self.dropped: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    @classmethod
    def from_config(cls, cfg) -> RecordChecker:
        return cls(cfg.on_bad_record, cfg.max_record_bytes, cfg.min_chars, cfg.max_chars)

    def check(self, value: Any, sf: Source, index: int, line: int | None, whole_file: bool = False) -> str | None:
        """The record's text, or None if it is dropped (raises under the 'error' policy). `whole_file`: the
        record is a whole text file (data.text_unit=file)."""
        if isinstance(value, bytes):
            if len(value) > self.limit:  # CSV fields and binary columns: the readers do not bound them
                return self._bad("too_long", f"{len(value)} bytes", sf, index, line, whole=whole_file)
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError as e:
                at = f" (line {line + value.count(NL, 0, e.start)})" if line is not None else ""
                return self._bad("invalid_utf8", f"byte {e.start} of the record{at} is not UTF-8", sf, index, line)
        elif isinstance(value, str):
            text = value
            if len(text) * 3 > self.limit or not text.isascii():
                try:
                    size = len(text.encode("utf-8"))
                except UnicodeEncodeError as e:
                    c = ord(text[e.start])  # a byte a reader could not decode comes as U+DC80..U+DCFF
                    why = f"byte 0x{c - 0xDC00:02X} is not UTF-8" if 0xDC80 <= c <= 0xDCFF else \
                        f"it holds a lone surrogate \\u{c:04x}"
                    return self._bad("invalid_utf8", f"character {e.start + 1}: {why}", sf, index, line)
                if size > self.limit:
                    return self._bad("too_long", f"{size} bytes", sf, index, line, whole=whole_file)
        elif value is readers.TOO_LONG:
            return self._bad("too_long", f"over {self.limit} bytes", sf, index, line, whole=whole_file)
        elif isinstance(value, readers.InvalidUTF8):
            return self._bad("invalid_utf8", value.why, sf, index, line)
        elif isinstance(value, readers.Null):
            return self._bad("missing_field", value.why, sf, index, line, "has a null text field")
        elif isinstance(value, readers.Missing):
            return self._bad("missing_field", value.why, sf, index, line)
        elif isinstance(value, readers.Malformed):
            return self._bad("malformed", value.why, sf, index, line)
        else:
            return self._bad("wrong_type", f"got {readers.json_type(value)}: {str(value)[:40]!r}", sf, index, line)
        if not text or text.isspace():
            return self.empty_file(sf) if whole_file else self._bad("empty", "", sf, index, line)
        if len(text) < self.min_chars:
            return self.drop("short", sf, index, line)
        if self.max_chars is not None and len(text) > self.max_chars:
            return self.drop("long", sf, index, line)
        return text

    def drop(self, reason: str, sf: Source | str, index: int | None, line: int | None) -> None:
        """Count a dropped record (or, with index None, a file) under `reason`."""
        self.dropped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES:
            url = sf if isinstance(sf, str) else sf.url
            ex.append(url if index is None else where(url, index, line))
        return None

    def damaged(self, sf: Source, why: str, fix: str | None = None) -> None:
        """A file that cannot be read to its end (truncated, corrupt, not its format): a DataError under the
        'error' policy; under 'skip' the file is counted (`damaged_file`) and its records read so far kept.
        `fix`: what to do, where the file is whole but of another kind than it is read as."""
        if self.policy == "error" and not sf.lenient:
            why = why.removeprefix(f"{sf.url}: ")
            if fix:
                raise DataError(f"{sf.url}: {why}. {fix}, or set data.on_bad_record=skip to pass over it (the file "
                                "is counted in the report)")
            raise DataError(f"{sf.url}: cannot read ({why}); the file may be truncated or corrupt. Fix or remove "
                            "it, or set data.on_bad_record=skip to keep the records read before the damage and go "
                            "on (the file is counted in the report)")
        self.drop("damaged_file", sf, None, None)

    def empty_file(self, sf: Source, whole: bool = True) -> None:
        """A file that is empty or only whitespace: a whole text file (`whole`), or one of records (JSON Lines,
        JSON, CSV/TSV). One found in a directory or by a glob (a package's empty __init__.py) is no bad record:
        it is counted (`empty`) whatever the policy. One named in data.sources is a DataError under the 'error'
        policy (a download that failed, a job that wrote nothing)."""
        if sf.named and self.policy == "error" and not sf.lenient:
            how = " (data.text_unit=file reads it as one document)" if whole else ""
            raise DataError(f"{sf.url}: the file is empty or only whitespace{how}, so it holds nothing to train "
                            "on. Give a file with text, remove it from "
                            "data.sources, or set data.on_bad_record=skip to pass over it (it is counted in the "
                            "report).")
        return self.drop("empty", sf.url, None, None)

    def _bad(self, reason: str, detail: str, sf: Source, index: int, line: int | None,
             what: str | None = None, whole: bool = False) -> None:
        """`whole`: the record is a whole text file (data.text_unit=file), which a line or paragraph unit splits."""
        if self.policy == "error" and not sf.lenient:
            place = where(sf.url, index, line) if index >= 0 else f"{sf.url}:{line}"
            detail = f" ({detail})" if detail else ""
            split = " (or read big text files with data.text_unit=line or paragraph)" if whole else ""
            fix = {"too_long": f"raise data.max_record_bytes{split}, ",
                   "missing_field": "set data.field, "}.get(reason, "")
            raise DataError(f"{place}: the record {what or REASONS[reason]}{detail}. Fix the data, {fix}or set "
                            f"data.on_bad_record=skip to skip such records (they are counted in the report).")
        return self.drop(reason, sf, index, line)


def doc_hash(text: str) -> int:
    """64-bit content hash of a document: the key of exact-duplicate removal and of the split."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def is_val(h: int, fraction: float) -> bool:
    """Whether the document of hash `h` belongs to the validation split."""
    return h < fraction * 2**64


class Deduplicator:
    """Remembers 64-bit document hashes in 8 bytes each: a sorted array plus a small recent set.

    Memory is 8 bytes per distinct document (800 MB for 100M documents), not the documents.
    """

    MERGE = 1 << 20

    def __init__(self):
        self.sorted = np.empty(0, np.uint64)
        self.recent: set[int] = set()

    def seen(self, h: int) -> bool:
        """True if `h` was seen before; otherwise remembers it."""
        if h in self.recent:
            return True
        s = self.sorted
        if s.size:
            i = int(np.searchsorted(s, np.uint64(h)))
            if i < s.size and int(s[i]) == h:
                return True
        self.recent.add(h)
        if len(self.recent) >= self.MERGE:
            self.sorted = np.union1d(s, np.fromiter(self.recent, np.uint64, len(self.recent)))
            self.recent = set()
        return False

    def __len__(self) -> int:
        return self.sorted.size + len(self.recent)
