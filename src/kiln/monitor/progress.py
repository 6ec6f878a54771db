"""Training progress as plain lines, for output that is not a terminal (a log file under Slurm, `kubectl logs`,
`nohup`, `> run.log`), where a progress bar that redraws itself shows nothing until it ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def duration(seconds: float) -> str:
    """Seconds for people: 45s, 12m05s, 3h02m, 2d04h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def memory(metrics: dict[str, Any]) -> str | None:
    """The run's memory for a progress line: the GPU's peak since the last record (`peak_mem_gib`), else this
    process tree's peak resident memory from the resource monitor (`sys/peak_rss_gib`, `sys/rss_gib`)."""
    for key, where in (("peak_mem_gib", "GPU"), ("sys/peak_rss_gib", "host"), ("sys/rss_gib", "host")):
        value = metrics.get(key)
        if isinstance(value, int | float):
            return f"{where} {value:.2f} GiB"
    return None


class ProgressLines:
    """Writes one line per logging step: `step 40/400 (10%)  loss 5.2345  lr 1.00e-03  2,530 tok/s  eta 2m31s
    mem host 0.42 GiB`. The time left is the wall time per step since the first line (start-up and the first steps'
    compilation left out; evaluations and checkpoints in, as they will be in the steps to come) times the steps
    left. `clock` gives seconds (tests pass a fake)."""

    def __init__(self, write: Callable[[str], None], total: int, clock: Callable[[], float] = time.monotonic):
        self.write, self.total, self.clock = write, total, clock
        self.first: tuple[float, int] | None = None  # (time, step) of the first line: the rate is measured from it
        self.start: tuple[float, int] | None = None  # (time, step) at the start of training: before any line

    def begin(self, step: int) -> None:
        self.start, self.first = (self.clock(), step), None

    def eta(self, step: int) -> str:
        now = self.clock()
        since = self.first or self.start
        if self.first is None:
            self.first = (now, step)
        if since is None or step <= since[1] or step >= self.total:
            return "-" if step < self.total else "0s"
        return duration((now - since[0]) / (step - since[1]) * (self.total - step))

    def line(self, step: int, metrics: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total} ({step / max(self.total, 1):.0%})", f"loss {metrics['loss']:.4f}",
                 f"lr {metrics['lr']:.2e}"]
        if "tokens_per_s" in metrics:
            parts.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
        parts.append(f"eta {self.eta(step)}")
        mem = memory(metrics)
        if mem is not None:
            parts.append(f"mem {mem}")
        return "  ".join(parts)

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        self.write(self.line(step, metrics))
