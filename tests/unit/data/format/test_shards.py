"""TokenStream: windows of the circular token stream and the document index of each position."""

from __future__ import annotations

import numpy as np

from ..conftest import make_stream


def expected_ids(start: int, m: int, ends: np.ndarray, L: int) -> np.ndarray:
    """Document index of positions start .. start + m - 1 of the circle, counted from the first."""
    doc_of = np.searchsorted(ends, np.arange(L), side="right")  # document of every stream position
    docs = doc_of[(start + np.arange(m)) % L]
    return np.concatenate([[0], np.cumsum(docs[1:] != docs[:-1])])


def test_document_ids_of_every_window_across_shards_and_the_wrap(tmp_path):
    """Every start position, so windows that cross a shard boundary (a document starts there) and the
    end of the stream are covered; the ids used to stay 0 across a shard boundary."""
    ts, ends = make_stream(tmp_path, "s", [[5, 5], [4, 6], [3], [7, 1, 2]])
    L = len(ts)
    for m in (1, 4, 9, 16, L + 3):
        out, ids = np.empty(m + 1, np.int64), np.empty(m, np.int32)
        for start in range(L):
            ts.read(start, out, ids)
            np.testing.assert_array_equal(out, (start + np.arange(m + 1)) % L + 1)  # tokens are positions + 1
            np.testing.assert_array_equal(ids, expected_ids(start, m, ends, L), err_msg=f"start {start}, m {m}")


def test_the_document_index_is_searched_with_its_own_dtype(tmp_path):
    """numpy < 2.5 converts the whole uint64 index to float64 on every searchsorted with Python ints (a
    12M tokens/s loader with 100-token documents): the keys must be uint64."""
    ts, _ = make_stream(tmp_path, "s", [[5, 5, 9], [4, 6]])
    keys = []

    class Recording(np.ndarray):
        def searchsorted(self, v, side="left", sorter=None):
            keys.append(np.asarray(v).dtype)
            return np.asarray(self).searchsorted(v, side, sorter)

    ts.ends = [e.view(Recording) for e in ts.ends]
    out, ids = np.empty(13, np.int64), np.empty(12, np.int32)
    for start in range(len(ts)):
        ts.read(start, out, ids)
    assert keys and set(keys) == {np.dtype(np.uint64)}
