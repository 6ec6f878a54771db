"""Random tokens for the benchmarks, read through Kiln's own loader: token shards of random documents
(log-normal lengths, each ending with EOS, id 0) written with `kiln.data.format.shards.write_shard`, and a
`PackedLoader` over them, so a benchmark's data goes through the same code, and the same state
(`state_dict`, `reset`), as a run's. Also document ids alone, for the attention benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.data.format.shards import TokenStream, write_shard
from kiln.data.load.loader import PackedLoader


def token_dtype(vocab: int) -> type:
    return np.uint16 if vocab <= 2**16 else np.uint32


def random_shards(root: str | Path, tokens: int, vocab: int, mean_doc: float, seed: int = 0,
                  shard_tokens: int = 20_000_000) -> list[tuple[Path, Path, int]]:
    """At least `tokens` random ids in [1, vocab) in documents of log-normal length (median ~ mean_doc / 1.6),
    written as shards under `root`; returns their (bin, idx, tokens) triples, as `TokenStream` takes them."""
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab)
    shards, made, s = [], 0, 0
    while made < tokens:
        docs, n = [], 0
        while n < min(shard_tokens, tokens - made):
            doc = rng.integers(1, vocab, max(2, int(rng.lognormal(np.log(mean_doc / 1.6), 1.0))), dtype=dtype)
            doc[-1] = 0  # EOS
            docs.append(doc)
            n += len(doc)
        entry = write_shard(root, f"train/{s:05d}", docs, dtype)
        shards.append((Path(root) / "train" / f"{s:05d}.bin", Path(root) / "train" / f"{s:05d}.idx", entry["tokens"]))
        made, s = made + n, s + 1
    return shards


def random_loader(root: str | Path, batch: int, seq: int, vocab: int, docs_per_row: float = 0, batches: int = 8,
                  prefetch: int = 2, seed: int = 0) -> PackedLoader:
    """Kiln's loader over `batches` batches' worth of random tokens written under `root` (then it goes round
    again, a new epoch): rows of `docs_per_row` documents on average with their doc_ids, or none (0: no
    document masking). Pinned for non-blocking copies where there is a GPU."""
    mean_doc = seq / docs_per_row if docs_per_row else 4.0 * seq
    shards = random_shards(root, batches * batch * (seq + 1), vocab, mean_doc, seed)
    stream = TokenStream(shards, token_dtype(vocab), name="random")
    return PackedLoader(stream, seq, batch, seed=seed, document_mask=bool(docs_per_row), prefetch=prefetch,
                        pin_memory=torch.cuda.is_available())


def doc_ids(B: int, T: int, median: float, seed: int = 0) -> torch.Tensor:
    """(B, T) int32 index of each position's document within its row: documents of log-normal length around
    `median` tokens, cut at the row's end."""
    rng = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        pos, d = 0, 0
        while pos < T:
            n = max(1, int(rng.lognormal(np.log(median), 1.0)))
            out[b, pos:pos + n] = d
            pos, d = pos + n, d + 1
    return torch.from_numpy(out)
