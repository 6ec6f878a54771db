"""Small token streams written with the real shard writer.

Token values encode their position (base + position + 1, EOS = 0 never used), so a test can tell
exactly which stream positions a batch holds; document ends are known from the lengths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.data.format.shards import TokenStream, write_shard


def make_stream(root: Path, name: str, doc_lengths: list[list[int]], base: int = 0, dtype=np.uint32):
    """Shards of documents with the given lengths (one inner list per shard).

    Returns (stream, doc_ends) where doc_ends are the global exclusive ends of all documents."""
    shards, pos, ends = [], base, []
    for s, lengths in enumerate(doc_lengths):
        docs = []
        for n in lengths:
            docs.append(np.arange(pos + 1, pos + 1 + n, dtype=np.int64))
            pos += n
            ends.append(pos - base)
        entry = write_shard(root / name, f"train/{s:05d}", docs, dtype)
        shards.append((root / name / "train" / f"{s:05d}.bin", root / name / "train" / f"{s:05d}.idx",
                       entry["tokens"]))
    return TokenStream(shards, dtype, name=name), np.array(ends)


@pytest.fixture
def stream(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [rng.integers(3, 90, size=n).tolist() for n in (40, 25, 33)]
    return make_stream(tmp_path, "ds-a", lengths)
