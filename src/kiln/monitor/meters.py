"""Throughput meters read at logging steps only: tokens/s, MFU, peak memory, time waiting for data."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

# dense (not 2:4 sparse) bf16 tensor-core peak FLOP/s per GPU, by a part of the name torch reports;
# the longest matching part wins ("H100 PCIe" before "H100"); train.peak_tflops overrides the table
PEAK_FLOPS = {
    "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H800": 989e12, "H20": 148e12,
    "B200": 2250e12, "B100": 1750e12, "GB200": 2500e12,
    "A100": 312e12, "A800": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "MI300X": 1307e12, "MI250X": 383e12,
}


def peak_for_name(name: str) -> float | None:
    """Dense bf16 peak of a GPU by its reported name, or None if the table does not know it."""
    matches = [key for key in PEAK_FLOPS if key in name]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from the table, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


class Throughput:
    """Measures the interval between two reads. `read` must follow a host sync (the loss read).
    `clock` gives seconds (time.perf_counter; tests pass a fake one)."""

    def __init__(self, flops_per_token: float, device: torch.device, peak: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.flops_per_token, self.device, self.clock = flops_per_token, device, clock
        self.peak = peak or peak_flops(device)
        self._t0, self._step0, self._wait, self._paused = clock(), 0, 0.0, 0.0

    def start(self, step: int) -> None:
        self._t0, self._step0, self._wait, self._paused = self.clock(), step, 0.0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

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
        if self.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._t0, self._step0, self._wait, self._paused = now, step, 0.0, 0.0
        return out
