"""Which tokens, and which documents, a global sample index of a run's training data names.

A rollback names the samples of a bad step by their global index in the loader's order ("passing over
its samples 1216..1231"); `sample_row` finds sample n's row as PackedRows reads it (the dataset the mixture
gives it, its row in that dataset's shuffled epoch) and the documents the row holds, by their index in
the split (kiln.data.prepare.provenance turns those into a source file and line).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from kiln.data.format.shards import TokenStream
from kiln.data.load.loader import PackedRows


@dataclass
class SampleRow:
    index: int  # the global sample index
    dataset: int  # which dataset of the run (its mixture entry)
    start: int  # offset of the row's first token in the dataset's token stream
    tokens: np.ndarray  # the row's seq_len + 1 tokens
    documents: list[tuple[int, int, int]] = field(default_factory=list)  # (document index, first, last) positions


def document_at(stream: TokenStream, pos: int) -> tuple[int, int]:
    """(index in the stream of the document holding token `pos`, the stream offset where it ends)."""
    s = bisect.bisect_right(stream._start_list, pos) - 1
    local = pos - stream._start_list[s]
    ends = stream.ends[s]
    i = int(ends.searchsorted(np.uint64(local), side="right"))
    before = sum(e.size for e in stream.ends[:s])
    return before + i, stream._start_list[s] + int(ends[i])


def sample_row(streams: list[TokenStream], seq_len: int, n: int, *, weights=None, seed: int = 0,
               shuffle: bool = True, schedule=None) -> SampleRow:
    """Sample `n` of a training loader over `streams` with these settings (as kiln.data.build makes it)."""
    rows = PackedRows(streams, seq_len, 1, weights=weights, seed=seed, shuffle=shuffle, document_mask=False,
                      schedule=schedule)
    src = rows.mixture.sources(0, n + 1)
    d = int(src[n])
    k = int(np.count_nonzero(src[:n] == d))  # samples the dataset gave before this one
    layout = rows.layouts[d]
    start = int(layout.starts(np.array([k], dtype=np.int64))[0])
    stream = layout.stream
    out = np.empty(seq_len + 1, dtype=stream.dtype)
    stream.read(start, out)
    row = SampleRow(n, d, start, out)
    pos, L = 0, len(stream)
    while pos <= seq_len:
        doc, end = document_at(stream, (start + pos) % L)
        last = min(seq_len, pos + (end - (start + pos) % L) - 1)
        row.documents.append((doc, pos, last))
        pos = last + 1
    return row
