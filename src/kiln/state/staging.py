"""Copies of the state that training may not change: CPU staging buffers and detached JSON parts.

`CpuStaging` keeps one CPU buffer per tensor of the state (pinned on CUDA; a DTensor's buffer is a CPU
DTensor of the same placements) and copies into it at every save, non-blocking, then waits for the
copies: 0.26 s at 1B on an H100, the device-to-host copy at PCIe speed. `allocate` makes the buffers
ahead of the first save, in a background thread, without copying.

Why not `torch.distributed.checkpoint.staging.DefaultStager`: it copies whole untyped storages
(`UntypedStorage.copy_`), which on the CPU measured 300x slower than tensor copies (0.3 s against
1 ms for the 1.4 MB tiny state; 12 ms against 0.25 ms for one 64 KB storage), so CPU runs would wait
on every save; and it cannot allocate its pinned buffers without a copy, so the first save of a
GPU run would wait for pinning the whole state (about 7 s at 1B). `dcp.save`, in the checkpointer's
own thread, writes the staged copy (checkpointer.py says why not `dcp.async_save`).
"""

from __future__ import annotations

import json
import mmap
import time
import weakref
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor


def on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


PIN_CHUNK = 16 << 20  # bytes page-locked per driver call: the training thread waits for one at most
PAGE = 4096


def pin_ranges(start: int, nbytes: int, chunk: int = PIN_CHUNK, page: int = PAGE) -> list[tuple[int, int]]:
    """(address, length) pieces that tile [start, start + nbytes), every boundary inside on a page: no page is
    in two pieces (the driver refuses to register a page twice)."""
    out, pos, end = [], start, start + nbytes
    while pos < end:
        nxt = (pos + chunk) // page * page
        nxt = end if nxt >= end or nxt <= pos else nxt
        out.append((pos, nxt - pos))
        pos = nxt
    return out


def own_pages(t: torch.Tensor) -> torch.Tensor:
    """Move the CPU tensor `t` (its contents are not kept) into memory of its own whole pages, in place: a
    buffer the allocator placed beside another shares a page with it, and the driver locks whole pages, so
    locking the second fails (or leaves it half locked, which a copy then refuses) once the first is locked.
    The pages are an anonymous mapping of their own, so the storage starts on one (`is_pinned` looks there)."""
    nbytes = max(t.untyped_storage().nbytes(), 1)
    pages = torch.frombuffer(mmap.mmap(-1, -(-nbytes // PAGE) * PAGE), dtype=torch.uint8)
    with torch.no_grad():
        t.set_(pages.untyped_storage(), 0, t.shape, t.stride())
    return t


def _pin(t: torch.Tensor) -> None:
    """Page-lock the memory of a CPU tensor (what `pin_memory=True` allocation does, for one we have).

    It is moved to pages of its own first (`own_pages`), they are touched (plain CPU work), then locked a piece
    of PIN_CHUNK bytes at a time, yielding between pieces: one call for a whole tensor of the state held the
    driver for up to a second while training went on in the other thread."""
    cudart = torch.cuda.cudart()
    own_pages(t)
    t.zero_()  # the pages exist before the driver locks them
    for ptr, size in pin_ranges(t.data_ptr(), t.numel() * t.element_size()):
        code = int(cudart.cudaHostRegister(ptr, size, 1))
        if code != 0:
            cudart.cudaGetLastError()  # not left for the next CUDA call of this thread to report as its own
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {code}")
        weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, ptr).atexit = False
        time.sleep(0)  # let the training thread run its next call


class CpuStaging:
    """Reusable CPU copies of nested dicts/lists of tensors (the layout is checked at every copy)."""

    def __init__(self, pin: bool | None = None):
        self.pin = on_cuda() if pin is None else pin
        self.buffers: Any = None

    def _new(self, src: torch.Tensor) -> torch.Tensor:
        if isinstance(src, DTensor):
            # a CPU DTensor: same mesh and placements, its local shard a new CPU tensor, made without reading the
            # state. src.to("cpu") would copy the shard: on a GPU, a blocking device-to-host copy of the whole
            # state queued behind training's kernels and ahead of the next ones (an 8B model's second step on 4
            # GPUs took 44 s instead of 15 while `allocate` did that in its thread)
            try:
                buf = torch.empty_like(src, device="cpu")
            except RuntimeError:  # a torch whose DTensor cannot make it empty: a copy, as before, rather than no save
                buf = src.to("cpu", copy=True)
            local = buf.to_local()
            if self.pin and local.numel():
                _pin(local)
            return buf
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
        if self.pin and buf.numel():
            _pin(buf)
        return buf

    def _walk(self, src: Any, old: Any, copy: bool) -> Any:
        if isinstance(src, torch.Tensor):
            fits = (isinstance(old, torch.Tensor) and isinstance(old, DTensor) == isinstance(src, DTensor)
                    and old.shape == src.shape and old.dtype == src.dtype
                    and (not isinstance(src, DTensor) or old.to_local().shape == src.to_local().shape))
            buf = old if fits else self._new(src)
            if copy:
                dst, s = (buf.to_local(), src.to_local()) if isinstance(src, DTensor) else (buf, src)
                dst.copy_(s, non_blocking=self.pin)
            return buf
        if isinstance(src, dict):
            return {k: self._walk(v, old.get(k) if isinstance(old, dict) else None, copy) for k, v in src.items()}
        if isinstance(src, (list, tuple)):
            olds = old if isinstance(old, (list, tuple)) and len(old) == len(src) else [None] * len(src)
            return type(src)(self._walk(v, o, copy) for v, o in zip(src, olds))
        return src

    def allocate(self, tree: Any) -> None:
        """Make the buffers for `tree` without copying (call in a background thread after the first step)."""
        with torch.no_grad():
            self.buffers = self._walk(tree, self.buffers, copy=False)

    def stage(self, tree: Any) -> Any:
        """Copy `tree` into the buffers (made or remade as needed); returns the staged tree."""
        with torch.no_grad():
            self.buffers = self._walk(tree, self.buffers, copy=True)
        if on_cuda():
            torch.cuda.synchronize()
        return self.buffers


def stage(staging: CpuStaging, tree: Any, log) -> tuple[CpuStaging, Any]:
    """Stage `tree` (returns the staging used: a plain-memory one if pinning fails) and the CPU copy."""
    try:
        return staging, staging.stage(tree)
    except RuntimeError as e:  # pinned (page-locked) memory is scarcer than plain memory
        if not staging.pin:
            raise
        log(f"could not pin CPU memory for checkpoint staging ({e}); using plain memory (slower)")
        plain = CpuStaging(pin=False)
        return plain, plain.stage(tree)


def clone_tree(obj: Any) -> Any:
    """A copy of nested dicts/lists whose tensors are cloned (other leaves are shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in nested dicts/lists (a DTensor counts its global size: what DCP writes in all)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    raise TypeError(f"{type(obj).__name__} in a state_dict() is not JSON data; return plain numbers and lists")


def json_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A detached, JSON-safe copy of small parts' state dicts."""
    return json.loads(json.dumps(state, default=_json_default))
