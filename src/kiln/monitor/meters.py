"""Throughput meters read at logging steps only: tokens/s, MFU, peak memory (since the last read), time waiting
for data, and on a GPU the caching allocator's retries (since the last read)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from kiln.plan.gpus import PEAK_FLOPS, peak_for_name  # the table lives with the planner (no torch there)

__all__ = ["PEAK_FLOPS", "Throughput", "peak_flops", "peak_for_name"]


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from the table, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def alloc_retries(device: torch.device) -> int:
    """How many times the CUDA caching allocator found no room for a block, freed its cached blocks and tried again
    so far: each retry's frees wait for the whole device, so the host waits (unseen by the sync debug mode)."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class Throughput:
    """Measures the interval between two reads. `read` must follow a host sync (the loss read).
    `clock` gives seconds (time.perf_counter; tests pass a fake one)."""

    def __init__(self, flops_per_token: float, device: torch.device, peak: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.flops_per_token, self.device, self.clock = flops_per_token, device, clock
        self.peak = peak or peak_flops(device)
        self._t0, self._step0, self._wait, self._paused = clock(), 0, 0.0, 0.0
        self._retries = 0  # the allocator's retries counted so far (CUDA)

    def start(self, step: int) -> None:
        self._t0, self._step0, self._wait, self._paused = self.clock(), step, 0.0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._retries = alloc_retries(self.device)

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        t = self.clock()
        yield
        self._wait += self.clock() - t

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside (an evaluation, say) is not training time: tokens/s and MFU leave it out."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # queued training work finishes on the training clock
        t = self.clock()
        yield
        self._paused += self.clock() - t

    def read(self, step: int, tokens_per_step: int) -> dict[str, float]:
        now = self.clock()
        dt = max(now - self._t0 - self._paused, 1e-9)
        tps = (step - self._step0) * tokens_per_step / dt
        out = {"tokens_per_s": tps, "data_wait": self._wait / dt}
        if self.peak and self.flops_per_token:
            out["mfu"] = tps * self.flops_per_token / self.peak
        if self.device.type == "cuda":  # the peak since the last read: each record its own interval's
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
            out["alloc_retries"] = alloc_retries(self.device) - self._retries
            self._retries += out["alloc_retries"]
        self._t0, self._step0, self._wait, self._paused = now, step, 0.0, 0.0
        return out
