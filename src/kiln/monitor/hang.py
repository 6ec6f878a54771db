"""Hangs: a step that takes far longer than usual says where every thread is, instead of hanging silently.

The loop alternates two phases: a step (`train_step` and the loss read of a logging step) and the
callbacks between two steps (evaluation, checkpoint saves, sinks). A thread watches the clock:

- a step running longer than monitor.hang_factor x the median step time (the median of the last
  100 steps, once 5 have run, so compilation is not measured; never less than monitor.hang_min_s),
  or the time between steps longer than monitor.hang_between_s, writes the stack of every thread
  (kiln.parallel.watch.thread_stacks) to <run_dir>/hang-step<N>.txt and says so on stderr;
- if there is still no progress monitor.hang_exit_s later, it writes an emergency checkpoint when
  the state is consistent (between steps, one process: kiln.state.preempt.emergency_checkpoint),
  and exits with code 124 and a message that says what happened and how to resume.

A step that finishes after its dump was only slow: the run goes on and the dump stays as a record.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.config import MonitorConfig
from kiln.events import Callback
from kiln.parallel.watch import thread_stacks

EXIT_CODE = 124  # as timeout(1): the run stopped itself because it made no progress
WARMUP_STEPS = 5  # steps before the median counts (compilation, allocator warm-up)
WINDOW = 100
POLL_S = 1.0


class HangWatch:
    """The clock side of hang detection; `check(now)` is called by its thread (or by tests)."""

    def __init__(self, cfg: MonitorConfig, run_dir: Path | None, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, exit_fn: Callable[[int], None] | None = None,
                 rescue: Callable[[], str] | None = None):
        self.cfg, self.run_dir, self.clock = cfg, (Path(run_dir) if run_dir else None), clock
        self.exit = exit_fn or os._exit  # os._exit: the main thread may be stuck where no exception reaches
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.rescue = rescue  # writes the emergency checkpoint; returns what happened, in words
        self.durations: deque[float] = deque(maxlen=WINDOW)
        self.phase: str | None = None  # "step", "between" or None (not training)
        self.step = 0  # the step running (phase "step") or the last one finished
        self.since = clock()
        self.dumped_at: float | None = None
        self.dumps: list[Path] = []
        self.aborted = False  # exit was called (once: a test's stand-in for os._exit returns)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the loop's marks (main thread)

    def step_started(self, step: int) -> None:
        """Step `step` begins (after the callbacks of the one before)."""
        self._enter("step", step)

    def step_ended(self, step: int) -> None:
        """Step `step` is done (before its callbacks)."""
        if self.phase == "step":
            self.durations.append(self.clock() - self.since)
        self._enter("between", step)

    def _enter(self, phase: str, step: int) -> None:
        now = self.clock()
        if self.dumped_at is not None:
            self.log(f"kiln: the {self._what()} went on after {now - self.since:.0f} s: it was slow, not hung "
                     f"(its stacks are in {self.dumps[-1]})")
        self.phase, self.step, self.since, self.dumped_at = phase, step, now, None

    def stopped(self) -> None:
        self.phase, self.dumped_at = None, None

    # ------------------------------------------------------------------ the watcher

    def median(self) -> float | None:
        return statistics.median(self.durations) if len(self.durations) >= WARMUP_STEPS else None

    def limit(self) -> float | None:
        """Seconds the current phase may take before it counts as a hang (None: not watched now)."""
        c = self.cfg
        if self.phase == "between":
            return c.hang_between_s or None
        med = self.median()
        if self.phase != "step" or not c.hang_factor or med is None:
            return None
        return max(c.hang_factor * med, c.hang_min_s)

    def _what(self) -> str:
        return f"step {self.step}" if self.phase == "step" else f"time after step {self.step}"

    def check(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        limit = self.limit()
        if limit is None or self.aborted:
            return
        if self.dumped_at is None:
            if now - self.since > limit:
                self._dump(now, limit)
        elif self.cfg.hang_exit_s and now - self.dumped_at > self.cfg.hang_exit_s:
            self._abort(now)

    def _dump(self, now: float, limit: float) -> None:
        self.dumped_at = now
        med = self.median()
        why = (f"{self.cfg.hang_factor:g} x the median step time {med:.2f} s" if self.phase == "step" and med
               and limit > self.cfg.hang_min_s else
               f"monitor.hang_min_s={self.cfg.hang_min_s:g} s" if self.phase == "step" else
               f"monitor.hang_between_s={self.cfg.hang_between_s:g} s")
        head = f"kiln: the {self._what()} has taken {now - self.since:.0f} s, over {limit:.0f} s ({why}); it may " \
               "be hung."
        stacks = thread_stacks()
        path = None
        if self.run_dir is not None:
            path = self.run_dir / f"hang-step{self.step}.txt"
            try:
                path.write_text(f"{head}\nStacks of every thread of process {os.getpid()}:\n\n{stacks}")
                self.dumps.append(path)
            except OSError:
                path = None
        then = (f" If nothing moves in {self.cfg.hang_exit_s:g} s (monitor.hang_exit_s), the run stops, with an "
                "emergency checkpoint where the state allows." if self.cfg.hang_exit_s else "")
        self.log(head + (f" The stack of every thread is in {path}." if path else "") + then
                 + ("" if path else f"\nStacks of every thread:\n{stacks}"))

    def _abort(self, now: float) -> None:
        self.aborted = True
        saved = "no emergency checkpoint (no checkpointer)"
        if self.rescue is not None:
            box: list[str] = []
            worker = threading.Thread(target=lambda: box.append(self.rescue()), name="kiln-hang-rescue", daemon=True)
            worker.start()
            worker.join(timeout=max(60.0, self.cfg.hang_exit_s))
            saved = box[0] if box else "the emergency checkpoint did not finish in time (it hangs too)"
        where = f" (stacks: {self.dumps[-1]})" if self.dumps else ""
        resume = f" Resume with: kiln train {self.run_dir}" if self.run_dir else ""
        self.log(f"kiln: stopping: the {self._what()} made no progress for {now - self.since:.0f} s{where}; "
                 f"{saved}. Exit code {EXIT_CODE}.{resume}")
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit(EXIT_CODE)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must not take the run down by itself
                self.log(f"kiln: hang watcher failed: {e!r}")
                return

    def start(self) -> HangWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kiln-hang-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.stopped()
        if self._thread is not None:
            self._thread.join(timeout=5)


def rescue_for(trainer, checkpointer, log: Callable[[str], None]) -> Callable[[], str]:
    """The emergency checkpoint of a hang, from the watcher's thread: only when the trainer is between steps,
    and discarded if the loop moved meanwhile (the copy would mix two steps)."""

    def rescue() -> str:
        from kiln.state.preempt import emergency_checkpoint, verify_first

        step, consistent = trainer.step, trainer.consistent
        if not consistent:
            return (f"no emergency checkpoint: the hang is inside step {step + 1}, whose state is half-updated; "
                    "the last complete checkpoint is kept")
        said: list[str] = []
        # one process (several save no emergency checkpoint): steps not yet checked for bad values are checked
        # here, before the step is read, as a bad one rolls the state back to the snapshot that is then saved
        if not checkpointer.distributed and not verify_first(trainer, said.append):
            return "; ".join(said)
        step, consistent = trainer.step, trainer.consistent
        path = emergency_checkpoint(trainer, checkpointer, TimeoutError("hang"), said.append)
        if path is not None and (trainer.step != step or not trainer.consistent):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            return "the emergency checkpoint was discarded: the loop moved while it was written"
        return f"emergency checkpoint of step {step} written to {path}" if path else "; ".join(said)

    return rescue


class HangMarks(Callback):
    """The loop's marks for a `HangWatch`: `first` goes first among the callbacks (a step ended), `last` goes
    last (the next step starts)."""

    def __init__(self, watch: HangWatch):
        self.watch = watch
        self.last = _NextStep(watch)

    def on_train_start(self, trainer) -> None:
        self.watch.start()
        self.watch.step_started(trainer.step + 1)

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        self.watch.step_ended(trainer.step)

    def on_train_end(self, trainer, metrics: dict[str, Any]) -> None:
        self.watch.stop()


class _NextStep(Callback):
    def __init__(self, watch: HangWatch):
        self.watch = watch

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if trainer.step < trainer.cfg.train.max_steps:  # after the last: the final evaluation and save, between
            self.watch.step_started(trainer.step + 1)
