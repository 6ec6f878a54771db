"""Streaming shard writer: one split's documents into shards of about `shard_tokens` tokens.

    <split>/00000.bin   flat token ids of whole documents
    <split>/00000.idx   uint64 exclusive end offset of each document in the .bin
    <split>/00000.json  the shard's manifest entry, written last: the shard is complete

Both data files are written as `.tmp`, fsynced and renamed into place (the .idx first), so a
reader never sees a partial shard; the `.json` beside them marks a shard that an interrupted
prepare does not need to write again. The sha256 covers the .bin bytes then the .idx bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from kiln.files import atomic_write, replace_file


def completed_shards(root: Path, split: str, dtype) -> list[dict]:
    """Entries of the shards of `split` already complete under `root`, in order; later ones, partial
    files and shards that do not match their entry are removed (they will be written again)."""
    d = root / split
    if not d.is_dir():
        return []
    done: list[dict] = []
    item = np.dtype(dtype).itemsize
    while True:
        base = d / f"{len(done):05d}"
        try:
            entry = json.loads(base.with_suffix(".json").read_text())
            ok = (base.with_suffix(".bin").stat().st_size == entry["tokens"] * item
                  and base.with_suffix(".idx").stat().st_size == entry["documents"] * 8)
        except (OSError, ValueError, KeyError):
            ok = False
        if not ok:
            break
        done.append(entry)
    keep = {f"{i:05d}{s}" for i in range(len(done)) for s in (".bin", ".idx", ".json")}
    for f in d.iterdir():
        if f.name not in keep:
            f.unlink()
    return done


class ShardWriter:
    def __init__(self, root: Path, split: str, dtype, shard_tokens: int, first: int = 0):
        self.dir = root / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.split, self.dtype, self.shard_tokens = split, np.dtype(dtype), shard_tokens
        self.index = first
        self.written: list[dict] = []
        self._f = None

    def _open(self) -> None:
        self.base = self.dir / f"{self.index:05d}"
        self._f = open(self.base.with_suffix(".bin.tmp"), "wb")
        self._hash = hashlib.sha256()
        self._ends: list[np.ndarray] = []
        self._tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents (`tokens` back to back, `lengths` their sizes), closing full shards."""
        start, i, n = 0, 0, len(lengths)
        while i < n:
            if self._f is None:
                self._open()
            ends = self._tokens + np.cumsum(lengths[i:])
            full = int(np.searchsorted(ends, self.shard_tokens, side="left"))  # doc that fills the shard
            j = min(n, i + full + 1)
            size = int(ends[j - i - 1]) - self._tokens
            chunk = tokens[start:start + size]
            self._f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            self._hash.update(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            self._ends.append(ends[: j - i])
            self._tokens += size
            start, i = start + size, j
            if self._tokens >= self.shard_tokens:
                self.finish()

    def finish(self) -> None:
        """Complete the current shard (if it holds anything)."""
        if self._f is None:
            return
        self._f.close()
        self._f = None
        idx = np.concatenate(self._ends).astype("<u8").tobytes()
        self._hash.update(idx)
        atomic_write(self.base.with_suffix(".idx"), idx)
        replace_file(self.base.with_suffix(".bin.tmp"), self.base.with_suffix(".bin"))
        entry = {"name": f"{self.split}/{self.index:05d}", "tokens": self._tokens, "documents": len(idx) // 8,
                 "sha256": self._hash.hexdigest()}
        atomic_write(self.base.with_suffix(".json"), json.dumps(entry))
        self.written.append(entry)
        self.index += 1
