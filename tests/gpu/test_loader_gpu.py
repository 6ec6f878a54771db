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


def test_a_batch_on_the_gpu_leaves_ddp_and_fsdp_nothing_to_copy_or_wait_for():
    """The trainer's batch reaches the GPU without a host sync, and DDP's and FSDP2's input move (_to_kwargs) is
    then a no-op; given a pinned CPU tensor instead, that move would wait for the GPU's whole queue."""
    from types import SimpleNamespace

    from torch.distributed.utils import _to_kwargs

    from kiln.train.trainer import Trainer

    cpu = [torch.zeros(4, 64, dtype=torch.int64).pin_memory() for _ in range(3)]
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = Trainer._batch(SimpleNamespace(device=dev), iter([tuple(cpu)]))
        moved = _to_kwargs(batch, {}, dev, False)[0][0]
        assert all(a is b for a, b in zip(moved, batch))
        try:
            _to_kwargs((cpu[2],), {}, dev, False)
        except RuntimeError as e:
            assert "synchroniz" in str(e)
        else:
            raise AssertionError("a CPU input was moved without a sync: the check above proves nothing")
    finally:
        torch.cuda.set_sync_debug_mode("default")
