"""The evaluation cadence, a callback of the training loop (`Callback` and `Events` live in kiln.events)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.events import Callback, Events

if TYPE_CHECKING:
    from kiln.train.trainer import Trainer

__all__ = ["Callback", "EvalEvery", "Events"]


class EvalEvery(Callback):
    """Evaluate every `every` steps (and always at the end of training)."""

    def __init__(self, every: int):
        self.every = every

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any] | None) -> None:
        if self.every and trainer.step % self.every == 0 and trainer.step < trainer.cfg.train.max_steps:
            trainer.evaluate()
