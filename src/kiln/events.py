"""Events the trainer emits and the callbacks that subscribe to them: the lowest layer of Kiln.

Logging, evaluation cadence and checkpoint cadence are callbacks, not branches in the loop. This
module imports nothing of Kiln, so sinks (monitor/), checkpoint policies (state/) and the loop
(train/) all build on it without importing each other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Trainer = Any  # kiln.train.trainer.Trainer, a higher layer: callbacks get it without this layer importing it


class Callback:
    """Override the hooks you need. `metrics` is a dict of plain Python numbers."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any] | None) -> None:
        """Called after every optimizer step; `metrics` is set on logging steps only."""

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_notice(self, trainer: Trainer, kind: str, info: dict[str, Any]) -> None:
        """Something the run did on its own (`kind`: auto_batch, oom,
        rollback, early_stop, warning: a resource running short, a slow step...); `info` is plain data."""

    def on_train_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_sample(self, trainer: Trainer, text: str) -> None:
        """Called with each text generated from the model (the sample at the end of a run), prompt included."""

    def on_run_end(self, trainer: Trainer, status: str) -> None:
        """Called once when this process is done with the run: 'finished' (after the model save and the
        sample), 'stopped' (a signal; its checkpoint is written) or 'failed' (an error). Flush and close here."""


class Sink(Callback):
    """A callback that only observes the run (console, files, dashboards, the profiler). If one of its
    hooks raises, `Events` logs the error and disables it for the rest of the run: a dashboard that is
    down or a full disk never stops training. Its `on_run_end` is still called, to release what it holds."""

    name = "sink"
    """What the log calls it when it fails."""
    disabled = False


class Events:
    """Fans each event out to the callbacks, in order. An error in a `Sink` is logged and disables that
    sink (it gets `on_run_end(trainer, "failed")` once); an error in any other callback propagates."""

    def __init__(self, callbacks: list[Callback], log: Callable[[str], None] | None = None):
        self.callbacks = list(callbacks)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.train_ended = False  # on_train_end was emitted: the loop ran to its end

    def emit(self, name: str, *args: Any) -> None:
        self.train_ended |= name == "on_train_end"
        for cb in self.callbacks:
            if not isinstance(cb, Sink):
                getattr(cb, name)(*args)
            elif not cb.disabled:
                try:
                    getattr(cb, name)(*args)
                except Exception as e:  # any failure of an observer is logged, not raised
                    self._disable(cb, name, e, args[0] if args else None)

    def _disable(self, sink: Sink, event: str, error: Exception, trainer: Any) -> None:
        sink.disabled = True
        self.log(f"the {sink.name} sink failed in {event} ({type(error).__name__}: {error}); it is disabled "
                 "for the rest of this run, and training goes on")
        if event != "on_run_end":
            try:
                sink.on_run_end(trainer, "failed")  # let it release files, threads and connections
            except Exception:  # it has failed once already; that is reported above
                pass

    def end_run(self, trainer: Trainer, error: BaseException | None) -> None:
        """Emit `on_run_end` with the status that `error` (None: none) and the events so far imply."""
        if error is None:
            status = "finished" if self.train_ended else "stopped"
        else:
            status = "stopped" if isinstance(error, KeyboardInterrupt) else "failed"
        self.emit("on_run_end", trainer, status)


class RunEnd:
    """`with RunEnd() as end:` around a run; set `end.trainer` once it exists. Leaving the block emits
    `on_run_end` to its callbacks (however it is left: returned, preempted, interrupted or failed), so
    sinks flush and close on SIGTERM as at the end."""

    def __init__(self):
        self.trainer: Trainer | None = None

    def __enter__(self) -> RunEnd:
        return self

    def __exit__(self, typ, error, tb) -> None:
        if self.trainer is not None:
            self.trainer.events.end_run(self.trainer, error)
