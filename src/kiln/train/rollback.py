"""Rollback of bad steps: a non-finite loss or gradient norm, or a loss spike, is undone and its samples skipped.

After every step, before it counts (before its snapshot, checkpoint or log line), `Rollback.check`
reads the step's loss (the mean over ranks) and gradient norm: one host read per step. A step is bad
when either is not finite, or when its loss is more than `recovery.spike_zscore` standard deviations
above the mean of the last `recovery.spike_window` good steps. A bad step is undone: the newest
in-memory snapshot (`kiln.state.snapshot`: weights, optimizer moments, schedule, loader position,
counters, random generators) is restored, the step's global samples go on the trainer's `SkipList`
(saved with its counters, so a resumed run passes over them too), the learning rate is optionally
lowered (`recovery.lr_factor`), and training goes on from the snapshot's step. The steps between the
snapshot and the bad one are trained again on the same samples; the bad step's samples are read and
passed over; so the weights come out as those of a run whose data never held them.

Snapshots are taken at the start (so a bad first step can be undone) and every
`checkpoint.snapshot_every` steps, or every `recovery.snapshot_every` when that is 0. A snapshot of a
fresh start records that the optimizer has no state yet and restores it so (reading its state would
create it, which changes the run).

More than `recovery.max_rollbacks` bad steps within `recovery.rollback_window` steps stop the run: the
last good state is restored, and a `TrainingError` naming the steps and their samples asks
`kiln.state.preempt.train_guarded` (through `emergency`) to save it as an emergency checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from kiln.config import RecoveryConfig
from kiln.dist.parallelize import reduce_mean
from kiln.errors import TrainingError
from kiln.events import Callback
from kiln.state.parts import trainer_parts
from kiln.state.snapshot import MemorySnapshots


class SkipList:
    """Global sample ranges [first, end) the loader passes over, each with the step that went bad on it."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, int]] = []

    def add(self, first: int, end: int, step: int) -> None:
        if (first, end, step) not in self.ranges:
            self.ranges.append((first, end, step))

    def covers(self, first: int, n: int) -> bool:
        """Whether any of samples first .. first + n - 1 is skipped."""
        return any(a < first + n and first < b for a, b, _ in self.ranges)

    def state_dict(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]

    def load_state_dict(self, state: list) -> None:
        self.ranges = [(int(a), int(b), int(s)) for a, b, s in state]


def set_lr_scale(scheduler, base_lrs: list[float], scale: float) -> None:
    """Make a LambdaLR's peak rates `scale` x `base_lrs` and set the optimizer's rates to match its position."""
    scheduler.base_lrs = [b * scale for b in base_lrs]
    lrs = [b * fn(scheduler.last_epoch) for b, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


class _FreshOptimizer:
    """The optimizer part of a snapshot taken before the first step: no state, and restored as none."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.state.clear()


class Rollback(Callback):
    """Checks every step and undoes bad ones (see the module doc). `snapshots` may be a checkpointer's, whose
    own cadence (`snapshot_every` > 0) then takes the snapshots after the first."""

    def __init__(self, rcfg: RecoveryConfig, snapshots: MemorySnapshots, snapshot_every: int = 0):
        self.rcfg, self.snapshots = rcfg, snapshots
        self.own_every = 0 if snapshot_every else rcfg.snapshot_every
        self.window: deque[tuple[int, float]] = deque(maxlen=rcfg.spike_window)  # (step, loss) of good steps
        self.bad: list[tuple[int, int, int]] = []  # (step, first sample, end) of each rollback

    def on_train_start(self, trainer) -> None:
        trainer.check_step = self.check
        snap = self.snapshots.snapshot
        if snap is None or snap.step != trainer.step:
            self.take(trainer)

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if self.own_every and trainer.step % self.own_every == 0:
            self.take(trainer)

    def take(self, trainer) -> None:
        parts = trainer_parts(trainer)
        if not trainer.optimizer.state:
            parts["optim"] = _FreshOptimizer(trainer.optimizer)
        self.snapshots.take(parts)

    def verdict(self, loss: float, gnorm: float) -> str | None:
        """Why a step with this loss and gradient norm is bad, or None if it is good."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(gnorm):
            return f"gradient norm is {gnorm}"
        z, n = self.rcfg.spike_zscore, self.rcfg.spike_window
        if z and len(self.window) >= n:
            values = [v for _, v in self.window]
            mean = sum(values) / n
            sd = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
            score = (loss - mean) / max(sd, 1e-6 * abs(mean), 1e-12)
            if score > z:
                return f"loss spike: {loss:.4f} is {score:.1f} standard deviations above the mean {mean:.4f} " \
                       f"of the last {n} steps (recovery.spike_zscore={z})"
        return None

    def check(self, trainer, loss: torch.Tensor, gnorm: torch.Tensor) -> bool:
        """After `train_step`, before the step counts: undo it if it is bad. True when it was undone."""
        values = torch.stack([loss.detach().float(), gnorm.detach().float().to(loss.device)])
        loss_v, gnorm_v = reduce_mean(values, trainer.mesh).tolist()  # kiln.dist: the same verdict on every rank
        reason = self.verdict(loss_v, gnorm_v)
        if reason is None:
            self.window.append((trainer.step + 1, loss_v))
            return False
        self.undo(trainer, reason)
        return True

    def undo(self, trainer, reason: str) -> None:
        step, (first, end) = trainer.step + 1, trainer.step_samples
        recent = [b for b in self.bad if b[0] > step - self.rcfg.rollback_window]
        stop = len(recent) >= self.rcfg.max_rollbacks
        skipped, scale = list(trainer.skips.ranges), trainer.lr_scale
        restored = self.snapshots.restore(self._parts(trainer))
        for r in [*skipped, (first, end, step)]:  # the restore brought back the snapshot's older list and scale
            trainer.skips.add(*r)
        self.bad.append((step, first, end))
        self.window = deque(((s, v) for s, v in self.window if s <= restored), maxlen=self.window.maxlen)
        trainer.set_lr_scale(scale * (self.rcfg.lr_factor if not stop else 1.0))
        trainer.consistent = True
        trainer.meter.start(trainer.step)  # the throughput clock restarts at the restored step
        samples = f"samples {first}..{end - 1}"
        trainer.notice("rollback", bad_step=step, reason=reason, to_step=restored, skipped=[first, end],
                       lr_scale=trainer.lr_scale, stop=stop,
                       message=f"step {step} went bad ({reason}): rolled back to step {restored}, passing over "
                               f"its {samples}" + (f"; learning rate now x{trainer.lr_scale:g}"
                                                   if trainer.lr_scale != 1.0 else ""))
        if stop:
            listing = "; ".join(f"step {s}: samples {a}..{b - 1}" for s, a, b in recent + [(step, first, end)])
            err = TrainingError(
                f"{len(recent) + 1} bad steps within {self.rcfg.rollback_window} steps (more than "
                f"recovery.max_rollbacks={self.rcfg.max_rollbacks}); the last: {reason}. Offending samples (global "
                f"indices, in the loader's order) - {listing}. The state of step {restored}, the last good one, is "
                "saved as an emergency checkpoint (with checkpoint.on_signal on; it passes over these samples when "
                "resumed). Check those samples in the data, lower train.lr or raise train.warmup_steps, then resume")
            err.emergency = True
            raise err

    def _parts(self, trainer):
        parts = trainer_parts(trainer)
        snap = self.snapshots.snapshot
        if snap is not None and not snap.tensors.get("optim"):
            parts["optim"] = _FreshOptimizer(trainer.optimizer)
        return parts
