"""The loader on a CUDA machine: pinned batches, non-blocking copies that match, prefetch thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.data.format.shards import TokenStream, write_shard
from kiln.data.load.loader import PackedLoader

pytestmark = pytest.mark.gpu


def test_pinned_batches_copy_exactly(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 60000, rng.integers(10, 500)).astype(np.uint16) for _ in range(300)]
    entry = write_shard(tmp_path, "train/00000", docs, np.uint16)
    stream = TokenStream([(tmp_path / "train/00000.bin", tmp_path / "train/00000.idx", entry["tokens"])],
                         np.uint16, name="gpu")
    pinned = PackedLoader(stream, 128, 8, prefetch=3, pin_memory=True)
    plain = PackedLoader(stream, 128, 8, prefetch=0)
    for _ in range(20):
        a, b = next(pinned), next(plain)
        assert all(t.is_pinned() for t in a)
        on_gpu = [t.to("cuda", non_blocking=True) for t in a]
        torch.cuda.synchronize()
        for g, c in zip(on_gpu, b):
            assert torch.equal(g.cpu(), c)
    pinned.close()
