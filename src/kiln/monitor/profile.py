"""A profiler window: a torch.profiler trace of a few training steps, written to <run_dir>/profile/.

`profile: {start: 20, steps: 5}` records optimizer steps 20 to 24 (CPU and CUDA activity, tensor shapes,
memory), after one warm-up step (19). The profiler exists only for those steps: it starts at the end
of step 18 and stops at the end of step 24, so the other steps run exactly as without it; with
profile.steps=0 (the default) there is no callback at all. At the end of the window:

- `steps-20-24.pt.trace.json`: a Chrome trace; open it in https://ui.perfetto.dev or chrome://tracing,
  or in TensorBoard's profiler plugin (`tensorboard --logdir <run_dir>/profile`). Each step is a
  `ProfilerStep#N` range, N the optimizer step;
- `top-ops.txt`, also printed: the ten operators (on CUDA: kernels) that took the most self time;
- with profile.memory_snapshot on CUDA, `memory-snapshot.pickle`: every allocation of the window with
  its stack, for https://pytorch.org/memory_viz. It is also written when the run fails inside the window
  (an out-of-memory error), which is when it is most useful.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from kiln.events import Sink


class ProfileWindow(Sink):
    """The callback of the `profile:` config section (rank 0 only). A Sink: if writing the trace fails,
    the failure is logged and training goes on."""

    name = "profiler"

    def __init__(self, pcfg, run_dir: Path, log: Callable[[str], None] = print):
        self.start, self.end = pcfg.start, pcfg.start + pcfg.steps - 1  # the optimizer steps recorded
        self.memory, self.shapes = pcfg.memory_snapshot, pcfg.shapes
        self.dir, self.log = Path(run_dir) / "profile", log
        self.prof: torch.profiler.profile | None = None
        self.warm: int | None = None  # the warm-up step, when there is one
        self.done = False
        self.cuda = False

    def action(self, step: int) -> ProfilerAction:
        """What the profiler does during optimizer step `step` (its schedule, in optimizer steps)."""
        if step == self.warm:
            return ProfilerAction.WARMUP
        if self.start <= step < self.end:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if step == self.end else ProfilerAction.NONE

    def on_train_start(self, trainer) -> None:
        if trainer.step + 1 > self.start:  # a resume that starts inside or after the window
            self.done = True
            self.log(f"profiler: steps {self.start}-{self.end} are behind this run (it starts at step "
                     f"{trainer.step + 1}); nothing is profiled. Set profile.start later to profile it")
        elif trainer.step + 1 >= self.start - 1:
            self._begin(trainer)

    def _begin(self, trainer) -> None:
        """Start the profiler at the end of step trainer.step, just before the warm-up (or first) step."""
        now = trainer.step
        self.warm = self.start - 1 if self.start - 1 > now else None
        self.cuda = trainer.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.memory and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        elif self.memory:
            self.log("profiler: profile.memory_snapshot needs CUDA; this run is on the CPU, so there is none")
        self.prof = torch.profiler.profile(activities=activities, schedule=self.action, on_trace_ready=self._ready,
                                           record_shapes=self.shapes, profile_memory=self.shapes)
        self.prof.step_num = now  # its steps are the optimizer steps; action(now) is NONE, so nothing runs yet
        self.prof.start()
        self.prof.step()  # on to step now + 1: the warm-up or the first recorded step
        self.log(f"profiler: recording steps {self.start}-{self.end}")

    def on_step_end(self, trainer, metrics) -> None:
        if self.prof is not None:
            self.prof.step()  # at the end of self.end: the trace is ready (written by _ready)
            if trainer.step >= min(self.end, trainer.cfg.train.max_steps):  # not the final evaluation
                self._finish()
        elif not self.done and trainer.step + 1 == self.start - 1:
            self._begin(trainer)

    def _ready(self, prof) -> None:
        last = min(prof.step_num - 1, self.end)  # step_num is the step after the last one recorded
        trace = self.dir / f"steps-{self.start}-{last}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=10)
        (self.dir / "top-ops.txt").write_text(table + "\n")
        self.log(f"profiler: trace of steps {self.start}-{last} written to {trace} (open it in "
                 f"https://ui.perfetto.dev); the top {'kernels' if self.cuda else 'operators'} by self time:\n"
                 f"{table}")

    def _finish(self) -> None:
        """Stop the profiler (writing the trace if the window was cut short) and the memory history."""
        prof, self.prof, self.done = self.prof, None, True
        try:
            prof.stop()
        finally:
            if self.memory and self.cuda:
                path = self.dir / "memory-snapshot.pickle"
                torch.cuda.memory._dump_snapshot(str(path))
                torch.cuda.memory._record_memory_history(enabled=None)
                self.log(f"profiler: CUDA memory snapshot written to {path} (open it in https://pytorch.org/memory_viz)")

    def on_train_end(self, trainer, metrics) -> None:
        if self.prof is not None:
            self._finish()

    def on_run_end(self, trainer, status: str) -> None:
        if self.prof is not None:  # stopped or failed inside the window
            self._finish()
