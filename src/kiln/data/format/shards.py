"""Token shards: write one, and read a split's shards as one circular token stream.

A shard is two files beside each other:

    <name>.bin  flat token ids (uint16 or uint32) of whole documents, each ending with EOS
    <name>.idx  numpy uint64 array (raw, little-endian): exclusive end offset of each document

`write_shard(dir, name, docs, dtype)` writes both atomically (temporary file, fsync, rename) and
returns the manifest entry `{"name", "tokens", "documents", "sha256"}`, where sha256 covers the
.bin then the .idx bytes. `TokenStream` memory-maps a list of shards and reads any window of
their concatenation, wrapping around at the end, with the document boundaries inside it.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.errors import DataError
from kiln.files import atomic_write

_REMEDY = "delete {0} and run the same `kiln prepare` again (`kiln prepare --verify {0}` lists every problem)"


def write_shard(directory: str | Path, name: str, docs: Sequence[np.ndarray], dtype) -> dict:
    """Write documents (each an array of token ids, EOS included) as shard `name` under `directory`.

    `name` may hold a sub-folder ("train/00000"). The .idx is renamed into place before the .bin, so
    a shard whose .bin exists is complete. Returns the manifest entry of the shard.
    """
    dtype = np.dtype(dtype)
    base = Path(directory) / name
    base.parent.mkdir(parents=True, exist_ok=True)
    arrays = [np.ascontiguousarray(d, dtype=dtype) for d in docs]
    if any(a.ndim != 1 for a in arrays):
        raise ValueError("write_shard: every document must be a 1-D array of token ids")
    ends = np.cumsum([a.size for a in arrays], dtype=np.uint64)
    bin_chunks = [memoryview(a).cast("B") for a in arrays if a.size]
    idx_bytes = ends.astype("<u8").tobytes()
    atomic_write(base.with_name(base.name + ".idx"), idx_bytes)
    atomic_write(base.with_name(base.name + ".bin"), bin_chunks)
    h = hashlib.sha256()
    for c in [*bin_chunks, idx_bytes]:
        h.update(c)
    return {"name": name, "tokens": int(ends[-1]) if ends.size else 0, "documents": len(arrays),
            "sha256": h.hexdigest()}


class TokenStream:
    """The concatenation of a split's shards, read as a circle of `len(self)` tokens.

    shards: (bin_path, idx_path, n_tokens) triples, as `PreparedDataset.shards(split)` gives them.
    vocab: the tokenizer's vocabulary size, if known: a token id read at or past it (a changed byte of a shard,
    which only `kiln prepare --verify` finds before) is a DataError naming the shard, not an index error (on a
    GPU, a device-side assert that ends the process) in the model's embedding.
    """

    def __init__(self, shards: Sequence[tuple[str | Path, str | Path, int]], dtype, name: str = "stream",
                 vocab: int | None = None):
        self.name, self.dtype = name, np.dtype(dtype)
        self.vocab = vocab if vocab is not None and vocab <= np.iinfo(self.dtype).max else None
        self.paths: list[Path] = []
        self.bins: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []  # per shard: document end offsets, shard-local
        sizes = []
        for bin_path, idx_path, n in shards:
            if not n:
                continue
            try:
                tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")
                ends = np.memmap(idx_path, dtype="<u8", mode="r").view(np.ndarray)  # page cache, shared by ranks
            except (OSError, ValueError) as e:
                raise DataError(f"cannot read shard {bin_path} ({e}); {_REMEDY.format(Path(bin_path).parent.parent)}"
                                ) from None
            if tokens.size != n or ends.size == 0 or int(ends[-1]) != n or int(ends[0]) == 0 \
                    or not bool(np.all(ends[1:] > ends[:-1])):
                raise DataError(f"shard {bin_path} does not match its manifest or index ({tokens.size} tokens, "
                                f"manifest says {n}; index of {ends.size} documents ending at "
                                f"{int(ends[-1]) if ends.size else 0}): the dataset is damaged; "
                                f"{_REMEDY.format(Path(bin_path).parent.parent)}")
            self.bins.append(tokens.view(np.ndarray))  # plain array view: no memmap overhead per slice
            self.paths.append(Path(bin_path))
            self.ends.append(ends)
            sizes.append(int(n))
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (n_shards + 1,)
        self._start_list = self.starts.tolist()
        self.documents = sum(e.size for e in self.ends)

    def __len__(self) -> int:
        return self._start_list[-1]

    def _pieces(self, start: int, n: int):
        """(shard, local_start, out_offset, length) pieces covering [start, start+n) of the circle."""
        L, done = len(self), 0
        pos = start % L
        while done < n:
            s = bisect.bisect_right(self._start_list, pos) - 1
            local = pos - self._start_list[s]
            take = min(n - done, self._start_list[s + 1] - pos)
            yield s, local, done, take
            done += take
            pos = (pos + take) % L

    def _out_of_vocab(self, s: int, local: int, piece: np.ndarray) -> None:
        at = int(np.argmax(piece >= self.vocab))
        path = self.paths[s]
        raise DataError(f"shard {path} holds token id {int(piece[at])} at token {local + at}, past the tokenizer's "
                        f"vocabulary of {self.vocab}: the dataset is damaged (a byte changed after it was made); "
                        f"{_REMEDY.format(path.parent.parent)}")

    def read(self, start: int, out: np.ndarray, doc_ids: np.ndarray | None = None) -> None:
        """Fill `out` with the tokens at [start, start + len(out)) of the circle, and `doc_ids`
        (optional, length <= len(out)) with the index of each position's document, from 0."""
        self.read_marked(start, out, doc_ids)
        if doc_ids is not None:
            np.add.accumulate(doc_ids, out=doc_ids)

    def read_marked(self, start: int, out: np.ndarray, doc_starts: np.ndarray | None = None) -> None:
        """As `read`, but `doc_starts` gets 1 where a document starts after the first position and 0
        elsewhere (its running sum is the document index; the loader sums a whole batch at once)."""
        n = out.size
        first = self._start_list
        pos = start % first[-1]
        s = bisect.bisect_right(first, pos) - 1
        if pos + n <= first[s + 1]:  # inside one shard: the common case, without the generator
            pieces = [(s, pos - first[s], 0, n)]
        else:
            pieces = list(self._pieces(start, n))
        for s, local, off, take in pieces:
            out[off:off + take] = self.bins[s][local:local + take]
            if self.vocab is not None and int(out[off:off + take].max()) >= self.vocab:
                self._out_of_vocab(s, local, out[off:off + take])
        if doc_starts is None:
            return
        m = doc_starts.size
        doc_starts[:] = 0
        for s, local, off, take in pieces:
            if off >= m:
                break
            doc_starts[off] = off > 0  # a piece after the first starts a shard, so a document
            # uint64 keys: numpy < 2.5 turns the whole index into float64 on every call given Python ints
            ends = self.ends[s]
            lo, hi = ends.searchsorted(np.array((local, local + min(take, m - off) - 1), np.uint64), side="right")
            if hi > lo:  # documents ending inside the piece: the next starts there
                doc_starts[ends[lo:hi].astype(np.intp) - (local - off)] = 1
