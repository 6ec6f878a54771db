"""What the planner knows of accelerators: memory, dense bf16 peak, and the MFU Kiln measured on them.

Plain data, no torch. `PEAK_FLOPS` is also what the MFU meter (kiln.monitor.meters) divides by.
The MFU points are Kiln's own measurements (benchmarks/results/*.md); a card without points
borrows the H100's curve and its plan says so.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

# dense (not 2:4 sparse) bf16 tensor-core peak FLOP/s per GPU, by a part of the name torch reports;
# the longest matching part wins ("H100 PCIe" before "H100"); train.peak_tflops overrides the table
PEAK_FLOPS = {
    "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H800": 989e12, "H20": 148e12,
    "B200": 2250e12, "B100": 1750e12, "GB200": 2500e12,
    "A100": 312e12, "A800": 312e12, "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 4080": 97.5e12, "RTX 3090": 71e12, "MI300X": 1307e12, "MI250X": 383e12,
}

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory: int  # bytes the card reports (torch.cuda.get_device_properties().total_memory)
    peak_flops: float | None  # dense bf16 FLOP/s; None for the CPU


# memory as the cards report it (MiB): H100 SXM 81559, H200 143771 (both measured on Kiln's machines)
GPUS = {g.key: g for g in (
    Gpu("h100", "NVIDIA H100 80GB HBM3", 81559 << 20, PEAK_FLOPS["H100"]),
    Gpu("h200", "NVIDIA H200", 143771 << 20, PEAK_FLOPS["H200"]),
    Gpu("a100", "NVIDIA A100-SXM4-80GB", 81920 << 20, PEAK_FLOPS["A100"]),
    Gpu("a100-40", "NVIDIA A100-SXM4-40GB", 40960 << 20, PEAK_FLOPS["A100"]),
    Gpu("l40s", "NVIDIA L40S", 46068 << 20, PEAK_FLOPS["L40S"]),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", 24564 << 20, PEAK_FLOPS["RTX 4090"]),
    Gpu("rtx4080", "NVIDIA GeForce RTX 4080", 16376 << 20, PEAK_FLOPS["RTX 4080"]),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", 24576 << 20, PEAK_FLOPS["RTX 3090"]),
    Gpu("a10g", "NVIDIA A10G", 23028 << 20, PEAK_FLOPS["A10G"]),
    Gpu("l4", "NVIDIA L4", 23034 << 20, PEAK_FLOPS["L4"]),
)}
ALIASES = {"a100-80": "a100", "4090": "rtx4090", "4080": "rtx4080", "3090": "rtx3090", "h100-80": "h100",
           "nvidia l4": "l4"}  # by its whole name: "l4" is a part of "l40s"


def peak_for_name(name: str) -> float | None:
    """Dense bf16 peak of a GPU by its reported name, or None if the table does not know it."""
    matches = [key for key in PEAK_FLOPS if key in name]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def gpu_for_name(name: str) -> Gpu | None:
    """The table's entry for a key ("h100", "rtx4090", "a100-40") or a name torch or NVML reports
    ("NVIDIA H100 80GB HBM3"), or None."""
    n = name.lower().strip()
    n = ALIASES.get(n, n)
    if n in GPUS:
        return GPUS[n]
    for part, key in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("l40s", "l40s"), ("4090", "rtx4090"),
                      ("3090", "rtx3090"), ("a10g", "a10g")):
        if part in n:
            return GPUS["a100-40" if key == "a100" and "40gb" in n.replace(" ", "") else key]
    return None


def cpu_gpu(memory: int) -> Gpu:
    """The CPU as a "device": its RAM, no FLOP table (`cpu_matmul_flops` measures its rate)."""
    return Gpu("cpu", "CPU", memory, None)


# the share of its fp32 matrix-product rate (`cpu_matmul_flops`) a training step on the CPU reaches, in model
# FLOPs: 0.4-0.56 measured for 0.4M-4M parameter models and about 1.0 at 25M (d=512), one thread, each step timed
# between two measurements of the rate on a loaded 2-core machine: an estimate good to a factor of two
CPU_STEP_SHARE = 0.5


@functools.lru_cache(maxsize=8)
def cpu_matmul_flops(threads: int, seconds: float = 0.3) -> float | None:
    """FLOP/s of 512 x 512 fp32 matrix products on this machine now, with `threads` intra-op threads (the
    best of three short runs: a loaded machine measures lower, as the run will then go)."""
    try:
        import time

        import torch
    except ImportError:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b
        best = 0.0
        for _ in range(3):
            t, n = time.perf_counter(), 0
            while time.perf_counter() - t < seconds / 3:
                a @ b
                n += 1
            best = max(best, n * 2 * 512**3 / (time.perf_counter() - t))
        return best
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- measured MFU

@dataclass(frozen=True)
class MfuPoint:
    params: int  # parameters of the model measured (vocab 32000)
    mfu: float  # model FLOPs (6N + 12LdT, no recompute) / peak, one GPU, compiled, bf16
    ac: str  # activation checkpointing of the measurement
    source: str


# one GPU, sequence 2048, vocab 32000, bf16, compiled, Kiln's own train step (benchmarks/throughput.py)
MFU_POINTS: dict[str, list[MfuPoint]] = {
    "h100": [
        MfuPoint(109_529_856, 0.458, "none", "throughput.md: 124m batch 16, H100, 2026-11-26"),
        MfuPoint(341_099_520, 0.511, "none", "throughput.md: 350m batch 32, H100, 2026-11-26"),
        MfuPoint(1_100_048_384, 0.526, "none", "throughput.md: 1b batch 8, H100, 2026-11-26"),
        MfuPoint(2_917_051_392, 0.541, "selective", "throughput.md: 3b batch 8 selective AC, H100, 2026-11-26"),
    ],
    "h200": [
        MfuPoint(109_529_856, 0.472, "none", "throughput.md: 124m batch 16, H200, 2026-11-26"),
        MfuPoint(1_100_048_384, 0.547, "none", "scaling.md: 1b kiln train, H200, 2026-11-26"),
    ],
}
FULL_AC_FACTOR = 0.84  # measured: 3b on an H100, full AC 45.4% MFU against selective 54.1% (throughput.md)
# eager against compiled, measured on an H200 (throughput.md): 124m 307K/511K tokens/s, 1b 53.8K/72.4K
EAGER_POINTS = [(109_529_856, 0.60), (1_100_048_384, 0.74)]
# measured (scaling.md, H200): 2 GPUs 91.8-93.8%, 4 GPUs 90.3% (124m DDP) and 92.7% (1b FSDP)
DATA_PARALLEL_FACTOR = 0.92
# the optimizer step on the CPU and the copies dominate; one process (train.offload's per-micro-batch schedule, which
# a mixture of experts keeps): Llama-3-8B at sequence 4096 on one H200 capped at 24 GiB, 2,616 tokens/s measured
# and 2,649 planned (benchmarks/results/offload.md, 2026-11-28 04:43; the layer-by-layer step is planned by
# kiln.plan.offload.host_seconds); several (FSDP's dist.cpu_offload): not measured
OFFLOAD_FACTOR = 0.3


def _interp(points: list[tuple[int, float]], params: int) -> float:
    """Linear in log(params) between the points; the end values beyond them."""
    points = sorted(points)
    if params <= points[0][0]:
        return points[0][1]
    if params >= points[-1][0]:
        return points[-1][1]
    for (n0, v0), (n1, v1) in zip(points, points[1:]):
        if n0 <= params <= n1:
            t = (math.log(params) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return v0 + t * (v1 - v0)
    return points[-1][1]


@dataclass(frozen=True)
class MfuEstimate:
    mfu: float
    basis: str  # where the number comes from, and how far it is from a measurement


def estimate_mfu(gpu_key: str, params: int, ac: str, compile: bool, gpus: int, offload: bool) -> MfuEstimate:
    """Model FLOPs utilisation expected on one GPU of the job, from the measured table."""
    own = gpu_key in MFU_POINTS
    points = MFU_POINTS[gpu_key if own else "h100"]
    mfu = _interp([(p.params, p.mfu) for p in points], params)
    notes = [("measured on this card" if own else "H100 measurements (none on this card)")]
    lo, hi = min(p.params for p in points), max(p.params for p in points)
    if not lo <= params <= hi:
        notes.append(f"extrapolated beyond {('the smallest' if params < lo else 'the largest')} model measured")
    if ac == "full":
        mfu *= FULL_AC_FACTOR
        notes.append("full AC: x0.84 measured")
    if not compile:
        mfu *= _interp(EAGER_POINTS, params)
        notes.append("no compile: x0.60-0.74 measured")
    if gpus > 1:
        mfu *= DATA_PARALLEL_FACTOR
        notes.append("data parallel: x0.92 measured on 2 and 4 GPUs" + ("" if gpus <= 4 else ", assumed beyond"))
    if offload:
        mfu *= OFFLOAD_FACTOR
        notes.append("CPU offload: x0.3, " + ("fitted to the one run measured (8B on an H200)" if gpus <= 1
                                               else "a guess, not measured"))
    return MfuEstimate(mfu, "; ".join(notes))


def local_device(choice: str | None, train_device: str) -> tuple[Gpu, str | None]:
    """The device a plan is for: `choice` (a table key or 'cpu'), else this machine's GPU, else the H100
    when the config asks for CUDA, else the CPU. Returns it and a note when it was assumed."""
    from kiln.errors import ConfigError

    if choice is not None:
        if choice.lower() == "cpu":
            return cpu_gpu(_ram()), None
        found = gpu_for_name(choice)
        if found is None:
            raise ConfigError(f"--gpu {choice}: not a card the planner knows; use one of "
                              f"{', '.join([*GPUS, 'cpu'])}")
        return found, None
    if train_device == "cpu":
        return cpu_gpu(_ram()), None
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            known = gpu_for_name(props.name)
            return known or Gpu("local", props.name, props.total_memory, peak_for_name(props.name)), None
    except Exception:  # noqa: BLE001 - no usable CUDA: plan for the default below
        pass
    if train_device.startswith("cuda"):
        return GPUS["h100"], "no GPU here: planned for an H100 (choose another with --gpu)"
    return cpu_gpu(_ram()), "no GPU here: planned for this machine's CPU (choose a card with --gpu)"


def is_here(gpu: Gpu) -> bool:
    """Whether `gpu` is this machine's own card (CUDA device 0, which `local_device` finds), so that a plan for it
    may measure the host it sits in (kiln.plan.host): False for the CPU and for a card named with --gpu that this
    machine lacks, whose run will be on another host."""
    if gpu.key == "cpu":
        return False
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        name = torch.cuda.get_device_properties(0).name
    except Exception:  # noqa: BLE001 - no usable CUDA: not this machine's card
        return False
    known = gpu_for_name(name)
    return gpu.key == known.key if known else gpu.key == "local" and gpu.name == name


def _ram() -> int:
    try:
        import psutil

        return psutil.virtual_memory().total
    except ImportError:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
