"""Rank sharding under a real torch.distributed process group (gloo, two processes)."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.data.build import data_position
from kiln.data.load.loader import PackedLoader

from ..conftest import make_stream

T, B, STEPS = 16, 3, 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        stream, _ = make_stream(__import__("pathlib").Path(root), "ds", [[40] * 30, [25] * 20])
        r, w = data_position()
        loader = PackedLoader(stream, T, B, seed=5, rank=r, world=w, prefetch=2)
        batches = torch.stack([next(loader)[1] for _ in range(STEPS)])  # (STEPS, B, T) targets
        gathered = [torch.empty_like(batches) for _ in range(w)]
        dist.all_gather(gathered, batches)
        states = [None] * w
        dist.all_gather_object(states, loader.state_dict())
        if rank == 0:
            torch.save({"batches": torch.stack(gathered), "states": states}, out)
        loader.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a real two-process gloo group
def test_ranks_of_a_process_group_partition_the_stream(tmp_path):
    out = str(tmp_path / "out.pt")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), out), nprocs=2, join=True)
    got = torch.load(out)
    assert got["states"][0] == got["states"][1]  # one global position on every rank
    per_rank = got["batches"]  # (world, STEPS, B, T)
    joined = torch.cat([per_rank[0], per_rank[1]], dim=1)  # (STEPS, 2B, T): rank 0's rows, then rank 1's
    stream, _ = make_stream(tmp_path / "single", "ds", [[40] * 30, [25] * 20])
    single = PackedLoader(stream, T, 2 * B, seed=5, prefetch=0)
    expected = torch.stack([next(single)[1] for _ in range(STEPS)])
    assert torch.equal(joined, expected)
    flat = joined.reshape(-1, T).numpy()
    assert len({row.tobytes() for row in flat}) == flat.shape[0]  # no row twice
    assert got["states"][0]["sample"] == STEPS * 2 * B
    assert np.all(flat > 0)
