"""Where the documents of a prepared dataset came from: the source file and line of document i of a split.

Shards keep tokens, not provenance. Prepare writes each split's documents in the order it reads them
(kiln.data.prepare.pipeline), so reading the sources again with the same settings (the same checks,
length filters, duplicate removal, split by content hash and data.max_bytes) finds document i of a split
at the i-th document of that split; reading stops at the last one asked for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from kiln.data.read.records import Deduplicator, RecordChecker, is_val
from kiln.data.read.sources import Document, expand, iter_documents


def find_documents(cfg, split: str, indices: Iterable[int]) -> dict[int, Document]:
    """{i: the Document} of the documents `indices` of `split` ('train' or 'val') of the dataset `cfg` (a
    DataConfig of data.sources) prepares; an index past the split's end is left out."""
    from kiln.data.prepare.pipeline import _limited

    wanted = set(indices)
    found: dict[int, Document] = {}
    if not wanted:
        return found
    last = max(wanted)
    files = expand(cfg.sources, cfg.format, cfg.dataset_split)
    checker = RecordChecker.from_config(cfg.model_copy(update={"on_bad_record": "skip"}))  # as prepared: it did
    dedup = Deduplicator() if cfg.dedup else None
    seen = 0
    for doc in _limited(iter_documents(cfg, files, checker=checker), cfg.max_bytes):
        h = int.from_bytes(hashlib.blake2b(doc.text.encode("utf-8"), digest_size=8).digest(), "little")
        if dedup is not None and dedup.seen(h):
            continue
        if ("val" if is_val(h, cfg.val_fraction) else "train") != split:
            continue
        if seen in wanted:
            found[seen] = doc
            if seen == last:
                break
        seen += 1
    return found
