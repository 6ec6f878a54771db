"""The pace of host memory for the offloaded step's AdamW (train.offload: optimizer; kiln.parallel.offload).

    pace = host_pace(here=True)     # measured on this machine (cached), else the assumed pace
    seconds = host_seconds(n, pace.bytes_per_s)

AdamW over fp32 master weights in host memory reads each parameter's weight, gradient and two moments and writes
three of them back: 28 bytes a parameter, at the pace of the host's memory, which differs twofold between GPU hosts
(benchmarks/host_adamw.py in benchmarks/results/offload.md: 43 GB/s on a 2x H200 host, about 89 on a one-H200
host). A plan for the machine it runs on measures it (`measure_adamw`: torch's fused CPU AdamW, the kernel the
offload steps with, a STEP_SLICE at a time, over PROBE_PARAMS parameters whose 256 MB of state the caches do not
hold, with the threads the offload's step takes; about 0.1-0.4 s). A plan for a card named with --gpu that this
machine lacks runs on another host than the run will: it assumes the pace Kiln fitted (HOST_STEP_BYTES_PER_S).

The step in training reaches STEP_SHARE of the kernel's pace alone: on the 2x H200 host the layer-by-layer step
took AdamW at 67 GB/s (HOST_STEP_BYTES_PER_S, fitted to the 8B run's 6.15 s) where benchmarks/host_adamw.py measured
43, and on the 4x H200 host at 64 GB/s beside the forward pass, 88 alone (its phases timed) where it measured 42:
the kernel alone, over freshly made tensors, reads low, not yet explained. Two hosts, so an estimate.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

from kiln.plan.offload import HOST_STEP_BYTES_PER_S

BYTES_PER_PARAM = 28  # fp32 weight, gradient and two moments read; weight and moments written
PROBE_PARAMS = 1 << 24  # 16M: four fp32 tensors of 64 MB, beyond a server CPU's caches per core
STEP_SLICE = 1 << 21  # kiln.parallel.offload.STEP_SLICE: elements AdamW steps at a time
STEP_SHARE = 1.5  # the training step's pace over the kernel's alone (see the module doc)


@dataclass(frozen=True)
class HostPace:
    """How fast the offloaded step's AdamW runs in host memory, and where that comes from."""

    bytes_per_s: float  # the step's pace at 28 bytes a parameter: what kiln.plan.offload.host_seconds divides by
    measured: float | None = None  # the fused kernel's pace measured on this machine; None: assumed

    def describe(self) -> str:
        if self.measured is None:
            return (f"host AdamW at {self.bytes_per_s / 1e9:.0f} GB/s assumed, as fitted on an H200's host "
                    "(measured when the plan is for this machine's own GPU)")
        return (f"host AdamW at {self.measured / 1e9:.0f} GB/s measured here, x{STEP_SHARE:.2f} in the step: "
                f"{self.bytes_per_s / 1e9:.0f} GB/s")


ASSUMED = HostPace(HOST_STEP_BYTES_PER_S)


def host_pace(here: bool) -> HostPace:
    """The pace a plan takes: measured where the plan is for this machine (`here`) and torch can measure it, else
    ASSUMED."""
    rate = measure_adamw() if here else None
    return HostPace(rate * STEP_SHARE, rate) if rate else ASSUMED


@functools.lru_cache(maxsize=4)
def measure_adamw(params: int = PROBE_PARAMS, passes: int = 3) -> float | None:
    """Bytes/s (at 28 a parameter) of torch's fused CPU AdamW over `params` fp32 parameters on this machine now,
    a STEP_SLICE at a time as the offload steps, with its threads (three quarters of torch's, the team
    kiln.parallel.offload.OptimizerOffload's AdamW thread takes): the best of `passes` after one to warm up. None
    without torch or its fused CPU kernel (the plan then assumes the fitted pace)."""
    try:
        import torch
    except ImportError:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before * 3 // 4))
    try:
        p, g = torch.full((params,), 0.02), torch.full((params,), 1e-3)
        m, v = torch.zeros(params), torch.zeros(params)
        step = torch.zeros(())
        best = math.inf
        for i in range(passes + 1):
            t = time.perf_counter()
            step += 1
            for lo in range(0, params, STEP_SLICE):
                hi = min(params, lo + STEP_SLICE)
                torch._fused_adamw_([p[lo:hi]], [g[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [step], amsgrad=False,
                                    lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False,
                                    grad_scale=None, found_inf=None)
            if i:  # the first pass warms up
                best = min(best, time.perf_counter() - t)
    except (AttributeError, RuntimeError, NotImplementedError):  # no fused CPU AdamW in this torch
        return None
    finally:
        torch.set_num_threads(before)
    rate = BYTES_PER_PARAM * params / best
    return rate if math.isfinite(rate) and rate > 0 else None
