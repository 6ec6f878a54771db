"""The resource monitor and the hang watch of one run, built from the config and hooked into the loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.config import RunConfig
from kiln.events import Callback
from kiln.monitor.hang import HangMarks, HangWatch, rescue_for
from kiln.monitor.resources import ResourceMonitor, Sampler, gpu_reader


class RunWatchers:
    """`first` go before every other callback (a step's end, readings into its metrics), `last` after
    them (the next step begins). `attach` once the trainer and checkpointer exist; `close` at the end."""

    def __init__(self, cfg: RunConfig, run_dir: Path, device, checkpoint_bytes: int, rank: int = 0,
                 log: Callable[[str], None] = print):
        m = cfg.monitor
        self.resources = None
        if m.resources and rank == 0:  # kiln.parallel: rank 0 reports; its GPU stands for the others
            try:
                sampler = Sampler(run_dir, cfg.data.cache_dir, gpu_reader(device, log))
                self.resources = ResourceMonitor(m, sampler, checkpoint_bytes, log)
            except ImportError:  # an environment installed before psutil became a dependency
                log("resource monitor off: it needs psutil (pip install psutil)")
        watch_on = m.hang_factor > 0 or m.hang_between_s > 0
        self.hang = HangWatch(m, run_dir if rank == 0 else None) if watch_on else None
        marks = HangMarks(self.hang) if self.hang is not None else None
        self.first: list[Callback] = [c for c in (marks, self.resources) if c is not None]
        self.last: list[Callback] = [marks.last] if marks is not None else []

    def attach(self, trainer, checkpointer, log: Callable[[str], None] = print) -> None:
        if self.hang is not None:
            self.hang.rescue = rescue_for(trainer, checkpointer, log)
        if self.resources is not None:
            checkpointer.room_hooks.append(self.resources.before_save)

    def close(self) -> None:
        if self.hang is not None:
            self.hang.stop()
        if self.resources is not None:
            self.resources.close()
