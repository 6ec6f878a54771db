"""The checkpoint cadence as a callback: snapshots, periodic saves, preemption and the final save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.events import Callback
from kiln.state.checkpointer import Checkpointer
from kiln.state.preempt import Preempted, SignalGuard


class CheckpointEvery(Callback):
    """Register it after the evaluation callback, so a checkpoint records the loss of its step."""

    def __init__(self, checkpointer: Checkpointer, guard: SignalGuard | None = None):
        self.ckpt, self.guard = checkpointer, guard

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        c, step = self.ckpt.ccfg, trainer.step
        self.ckpt.poll()  # a failed background save stops the run here, not silently
        self._tell(trainer)
        if c.async_save:
            self.ckpt.warm_up(trainer)
        if c.snapshot_every and step % c.snapshot_every == 0:
            self.ckpt.take_snapshot(trainer)
        signame = self.guard.should_stop(step) if self.guard else None
        if signame:
            path = self.ckpt.save(trainer, "preempt", blocking=True)  # a rollback there saves the snapshot's step
            self._tell(trainer)
            raise Preempted(signame, trainer.step, path)
        last = step >= trainer.cfg.train.max_steps or getattr(trainer, "stop_reason", None)  # the final save follows
        if c.every and step % c.every == 0 and not last:
            self.ckpt.save(trainer)

    def on_train_end(self, trainer, metrics: dict[str, Any]) -> None:
        if self.ckpt.ccfg.at_end:
            self.ckpt.save(trainer, "final")
        self.ckpt.wait()  # a periodic save still being written finishes before the run ends
        self._tell(trainer)

    def _tell(self, trainer) -> None:
        """A notice of each save completed since the last (train.log, metrics.jsonl, the console): where the run
        can resume from, and when it got there."""
        for done in self.ckpt.take_completed():
            name = Path(done["path"]).name
            trainer.notice("checkpoint", **done, message=f"{name} saved ({done['reason']}, "
                                                          f"{done['bytes'] / 2**20:,.1f} MiB, {done['seconds']:.1f} s)")
