"""Events the trainer emits and the callbacks that subscribe to them: the lowest layer of Kiln.

Logging, evaluation cadence and checkpoint cadence are callbacks, not branches in the loop. This
module imports nothing of Kiln, so sinks (monitor/), checkpoint policies (state/) and the loop
(train/) all build on it without importing each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the trainer is a higher layer
    from kiln.train.trainer import Trainer


class Callback:
    """Override the hooks you need. `metrics` is a dict of plain Python numbers."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any] | None) -> None:
        """Called after every optimizer step; `metrics` is set on logging steps only."""

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_notice(self, trainer: Trainer, kind: str, info: dict[str, Any]) -> None:
        """Something the run did on its own (`kind`: auto_batch, oom, rollback, ...); `info` is plain data."""

    def on_train_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...


class Events:
    """Fans each event out to the callbacks, in order."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def emit(self, name: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, name)(*args)
