"""Checkpoint staging: the staged copy is a copy, never the live state (which training goes on changing)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from kiln.state.staging import CpuStaging


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_process(monkeypatch):
    """A one-process gloo group on the CPU: the mesh of a CPU DTensor."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo")
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_staged_tensors_and_cpu_dtensors_do_not_alias_the_live_state(one_process):
    live = {"w": distribute_tensor(torch.randn(8, 4), one_process, [Shard(0)]), "b": torch.randn(4)}
    staging = CpuStaging(pin=False)
    for _ in range(2):  # the first save makes the buffers, the second reuses them
        staged = staging.stage(live)
        before = {k: (v.to_local() if k == "w" else v).clone() for k, v in staged.items()}
        with torch.no_grad():  # training goes on while the copy is written
            live["w"].to_local().add_(1.0)
            live["b"].add_(1.0)
        assert torch.equal(staged["w"].to_local(), before["w"])  # a CPU DTensor's buffer came back itself
        assert torch.equal(staged["b"], before["b"])
        assert staged["w"].placements == live["w"].placements


@pytest.mark.parametrize("start,nbytes", [(0, 1), (4096, 4096), (100, 50_000_000), (4095, 33 << 20), (12345, 16 << 20)])
def test_pin_ranges_tile_the_tensor_with_no_page_in_two_pieces(start, nbytes):
    from kiln.state.staging import PAGE, PIN_CHUNK, pin_ranges

    pieces = pin_ranges(start, nbytes)
    assert pieces[0][0] == start and sum(n for _, n in pieces) == nbytes
    for (a, n), (b, _) in zip(pieces, pieces[1:]):
        assert a + n == b and b % PAGE == 0  # contiguous, and each boundary on a page
    assert all(0 < n <= PIN_CHUNK for _, n in pieces)


def test_allocating_the_buffers_reads_nothing_of_the_state(one_process):
    """`allocate` runs beside training: making a buffer must not copy the state (on a GPU that copy is a blocking
    device-to-host transfer of the whole state in training's stream)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    live = {"w": distribute_tensor(torch.randn(8, 4), one_process, [Shard(0)]), "b": torch.randn(4)}
    staging = CpuStaging(pin=False)
    with Ops() as ops:
        staging.allocate(live)
    assert not [n for n in ops.names if "copy" in n or "clone" in n], ops.names
    assert staging.buffers["w"].placements == live["w"].placements
    assert staging.buffers["w"].to_local().data_ptr() != live["w"].to_local().data_ptr()
    staged = staging.stage(live)  # and the buffers it made take the copy
    assert torch.equal(staged["w"].to_local(), live["w"].to_local()) and staged["w"] is staging.buffers["w"]


class _Driver:
    """cudaHostRegister as the driver does it: whole pages, and a page locked twice is refused."""

    def __init__(self):
        from kiln.state.staging import PAGE

        self.page, self.locked = PAGE, set()

    def cudaHostRegister(self, ptr, size, flags):
        pages = set(range(ptr // self.page, (ptr + size - 1) // self.page + 1))
        if pages & self.locked:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.locked |= pages
        return 0

    def cudaHostUnregister(self, ptr):
        return 0

    def cudaGetLastError(self):
        return 0


def test_pinned_buffers_of_small_tensors_side_by_side_each_lock_their_own_pages(one_process, monkeypatch):
    """A state holds many small tensors (norm weights, step counters) that the allocator puts side by side: each
    pinned buffer must be locked on pages of its own, or the second one's lock fails and the save falls back to
    slow plain memory (seen on an H200 as 'could not pin CPU memory for checkpoint staging')."""
    driver = _Driver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    live = {f"t{i}": torch.randn(i + 1) for i in range(40)}
    live["w"] = distribute_tensor(torch.randn(8, 4), one_process, [Shard(0)])
    staging = CpuStaging(pin=True)
    staged = staging.stage(live)
    for k, v in live.items():
        got = staged[k].to_local() if k == "w" else staged[k]
        assert torch.equal(got, v.to_local() if k == "w" else v)
        assert got.data_ptr() % 4096 == 0 and got.untyped_storage().data_ptr() == got.data_ptr()
