"""`profile:` and `monitor:` a profiler window, resource readings and hang detection."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import Section


class ProfileConfig(Section):
    """A torch.profiler window (off unless profile.steps > 0): a trace of a few steps in <run_dir>/profile/."""

    start: int = Field(10, ge=1)
    """First optimizer step recorded (counted from 1; the step before it warms the profiler up)."""
    steps: int = Field(0, ge=0)
    """Steps recorded from profile.start on (0: no profiler at all)."""
    memory_snapshot: bool = False
    """On CUDA, also record every allocation in the window and write a memory snapshot (for OOM debugging)."""
    shapes: bool = True
    """Record each operator's input shapes and memory use in the trace. Their cost on the host, per operator, stretches
    a step bound by the host (a small model; a mixture of experts on many GPUs, where the other ranks wait for the
    profiled rank 0): false for a trace whose GPU idle time is the unprofiled step's."""


class MonitorConfig(Section):
    """The resource monitor and the hang detector (kiln.monitor.resources, kiln.monitor.hang)."""

    resources: bool = True
    """Sample GPU (NVML: utilisation, memory, power, temperature, clocks), CPU, host memory, disk rates and free
    space in a background thread at every logging step; the readings go to every sink as sys/* metrics."""
    data_wait_warn: float = Field(0.10, ge=0, le=1)
    """Warn when the training loop waits for data more than this fraction of the time, over the last 5 logging
    intervals (the first one after a start, and the first 10 steps, are the loader's warm-up and do not count);
    again after it has recovered (under half of this)."""
    gpu_memory_warn: float = Field(0.95, gt=0, le=1)
    """Warn once when a GPU's used memory passes this fraction of its total."""
    host_memory_warn: float = Field(0.95, gt=0, le=1)
    """Warn when the host's used memory passes this fraction of its total (the kernel's out-of-memory killer
    is near: it ends a process without a word); again after it has gone back under it by 5 points."""
    disk_checkpoints_warn: float = Field(2.0, ge=0)
    """Warn once when the run directory's disk has less free space than this many checkpoints (checked before
    every save and at logging steps; 0: no warning). A save that cannot fit at all is refused regardless."""
    hang_factor: float = Field(10.0, ge=0)
    """A step slower than this multiple of the median step time is treated as a hang: the stack of every thread
    goes to <run_dir>/hang-step<N>.txt (0: steps are not watched)."""
    hang_min_s: float = Field(60.0, gt=0)
    """A step is never treated as a hang before this many seconds, whatever the median."""
    hang_between_s: float = Field(1800.0, ge=0)
    """The time between two steps (evaluation, checkpoint saves, sinks) is a hang past this many seconds
    (0: not watched)."""
    hang_exit_s: float = Field(900.0, ge=0)
    """This long after a hang's stack dump with still no progress, write an emergency checkpoint (when the
    state is between steps, in a one-process run) and exit with code 124 (0: never exit, only dump)."""
