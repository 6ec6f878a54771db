"""Rollback of bad steps: a non-finite loss or gradient norm, a loss above a bound, a one-batch loss spike or a
divergence is undone and its samples skipped.

Which steps are bad is `kiln.train.spikes`' business (a spike that persists while the model still fits the data
it learnt before is a change of data, trained through).

Reading those values back costs a host sync, which would make the CPU wait for the device to
finish every step instead of queueing the next one; so `Rollback.check` only notes each step's loss and
gradient norm (on the device, with its step and global samples) in `pending`, and the noted steps are
checked, in order and with one read (and one all-reduce over several processes), where the state is
consumed or shown: the check points. They are the steps that log (`logging.every`, where the check shares the
trainer's read of the loss and throughput, `kiln.train.trainer.StepRead`, and its one all-reduce), take a
memory snapshot (so a snapshot only ever holds checked state), save a checkpoint (`checkpoint.every`),
evaluate (`train.eval_every`), the last step, and a step after which a stop was asked for. Anything else
that saves or snapshots the state checks it first through `trainer.verify_pending` (`Checkpointer.save`,
`Checkpointer.take_snapshot`, `kiln.state.preempt.emergency_checkpoint`, the preemption save of a signal,
the end of `Trainer.train`), so a checkpoint of an unchecked, possibly NaN
state cannot be written. The check points are decided by step counters and by the stop flags that are
already the same on every rank (`SignalGuard.should_stop` is a collective), so every rank checks the same
steps and reaches the same verdict. Because every snapshot step is a check point, a bad step is found at the
latest at the next check point, which is at most `logging.every` steps and never past the next snapshot (a
spike at the last step noted waits for one more check, to see the steps after it, but never past a snapshot):
the work thrown away on a rollback is bounded by the snapshot cadence, as when every step was checked.

A bad step k is undone: the good steps noted before it join the spike window, the newest good state is
restored: the in-memory snapshot (`kiln.state.snapshot`: weights, optimizer moments, schedule, loader position,
counters, random generators; it is at or before the first noted step), or a complete checkpoint on disk that is
newer than it and older than k (then loaded, its files verified, and snapshotted), step k's global samples go on the
trainer's `SkipList` (saved with its counters, so a resumed run passes over them too), the learning rate is
optionally lowered (`recovery.lr_factor`), and training goes on from the snapshot's step. The steps noted
after k were trained on its weights and are dropped. The steps between the snapshot and k are trained again
on the same samples, k's samples are read and passed over, and the steps after it are trained again on
theirs; so the weights come out as those of a run whose data never held them.

Snapshots are taken at the start (so a bad first step can be undone) and every
`checkpoint.snapshot_every` steps, or every `recovery.snapshot_every` when that is 0. A snapshot of a
fresh start records that the optimizer has no state yet and restores it so (reading its state would
create it, which changes the run).

More than `recovery.max_rollbacks` bad steps within `recovery.rollback_window` steps stop the run: the
last good state is restored, and a `TrainingError` naming the steps and their samples asks
`kiln.state.preempt.train_guarded` (through `emergency`) to save it as an emergency checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kiln.config import RecoveryConfig
from kiln.errors import TrainingError
from kiln.events import Callback
from kiln.parallel.parallelize import reduce_mean
from kiln.state.parts import trainer_parts
from kiln.state.rundir import checkpoints, from_rank0, step_of
from kiln.state.snapshot import MemorySnapshots
from kiln.train.spikes import SpikeDetector


def host_room(model: torch.nn.Module, copies: int, local_world: int, share: float = 0.75) -> tuple[bool, int, int]:
    """Whether `copies` host copies of every process's training state (this process's weights, plus two AdamW
    moments of each trainable one) fit in `share` of the host's available memory. Returns (fits, bytes needed
    by the node's processes, bytes available). A rollback snapshot is one copy, an async checkpoint's staging
    another: at 8B under FSDP on two GPUs that is 64 GB a process each."""
    per = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # kiln.parallel: an FSDP2 shard
        n = local.numel() * local.element_size()
        per += 3 * n if p.requires_grad else n
    need = per * copies * local_world
    try:
        import psutil

        have = psutil.virtual_memory().available
    except ImportError:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return need <= share * have, need, have


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


def host_read(values: torch.Tensor, mesh) -> list:
    """The mean over ranks of `values`, read back to the host: the one sync (and collective) of a check."""
    return reduce_mean(values, mesh).tolist()  # kiln.parallel: the same verdict on every rank


class Rollback(Callback):
    """Notes every step and checks the noted ones at the check points, undoing a bad one (see the module doc).
    `snapshots` may be a checkpointer's, whose own cadence (`snapshot_every` > 0) then takes the snapshots
    after the first; with `checkpointer`, a newer complete checkpoint of its run is a state to go back to.
    `bound`: the loss above which a step is bad from the start (kiln.train.spikes.loss_bound)."""

    state_key = "rollback"  # the detector's window and the rollbacks so far, saved with the trainer's counters

    def __init__(self, rcfg: RecoveryConfig, snapshots: MemorySnapshots, snapshot_every: int = 0,
                 checkpointer=None, bound: float | None = None):
        self.rcfg, self.snapshots, self.checkpointer = rcfg, snapshots, checkpointer
        self.own_every = 0 if snapshot_every else rcfg.snapshot_every
        self.spikes = SpikeDetector(rcfg, bound)
        self.bad: list[tuple[int, int, int]] = []  # (step, first sample, end) of each rollback
        # the steps not yet checked: (step, first sample, end, [loss, grad norm] on the device)
        self.pending: list[tuple[int, int, int, torch.Tensor]] = []
        # the newest noted step and the first noted since the last check, with their batches: references to be
        self.latest: tuple[int, tuple] | None = None
        self.first: tuple[int, tuple] | None = None

    @property
    def window(self):
        return self.spikes.window

    def state_dict(self) -> dict[str, Any]:
        return {**self.spikes.state_dict(), "bad": [list(b) for b in self.bad]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spikes.load_state_dict(state)
        self.bad = [(int(s), int(a), int(b)) for s, a, b in state.get("bad", [])]

    def on_train_start(self, trainer) -> None:
        trainer.check_step, trainer.verify_pending = self.check, self.verify
        self.pending.clear()
        snap = self.snapshots.snapshot
        if snap is None or snap.step != trainer.step:
            self.take(trainer)

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if self.own_every and trainer.step % self.own_every == 0:
            self.take(trainer)

    def take(self, trainer) -> None:
        self.verify(trainer)  # a check point already: nothing is pending, unless a caller took one elsewhere
        parts = trainer_parts(trainer)
        if not trainer.optimizer.state:
            parts["optim"] = _FreshOptimizer(trainer.optimizer)
        self.snapshots.take(parts)

    def due(self, trainer, step: int) -> bool:
        """Whether `step` is a check point: its state is logged, snapshotted, saved or evaluated, or it is the
        last. The same answer on every rank (step counters, and a stop_reason every rank sets together)."""
        cfg = trainer.cfg
        if step >= cfg.train.max_steps or trainer.stop_reason is not None:
            return True
        cadences = (cfg.logging.every, self.own_every, cfg.checkpoint.snapshot_every, cfg.checkpoint.every,
                    cfg.train.eval_every)
        return any(n and step % n == 0 for n in cadences)

    def check(self, trainer, loss: torch.Tensor, gnorm: torch.Tensor, read: Callable | None = None) -> bool:
        """After `train_step`, before the step counts: note it (no host sync); at a check point, check the noted
        steps. `read`: a logging step's host read (`kiln.train.trainer.StepRead`), which the check shares.
        True when one was bad and the state is back at the snapshot."""
        values = torch.stack([loss.detach().float(), gnorm.detach().float().to(loss.device)])
        step = trainer.step + 1
        self.pending.append((step, *trainer.step_samples, values))
        self.latest = (step, trainer.batch)
        if len(self.pending) == 1:  # copied: the loader may reuse its buffers before the check
            self.first = (step, tuple(None if t is None else t.clone() for t in trainer.batch))
        return self.due(trainer, step) and self.verify(trainer, read, may_wait=not self.keeps(trainer, step))

    def keeps(self, trainer, step: int) -> bool:
        """Whether the state of check point `step` is kept or acted on (snapshot, checkpoint, evaluation, the end,
        a stop) rather than only logged: then no verdict may wait for the steps after it."""
        cfg = trainer.cfg
        if step >= cfg.train.max_steps or trainer.stop_reason is not None:
            return True
        cadences = (self.own_every, cfg.checkpoint.snapshot_every, cfg.checkpoint.every, cfg.train.eval_every)
        return any(n and step % n == 0 for n in cadences)

    def verify(self, trainer, read: Callable | None = None, may_wait: bool = False) -> bool:
        """Check the noted steps in order with one host read: good ones join the spike window; the first bad one
        is undone (the steps noted after it, trained on its weights, are dropped). True if one was undone.
        `read(values)` gives the means over ranks of values on the device (default: `host_read`). `may_wait`: a
        spike at the last noted step stays noted, to be judged with the steps after it at the next check."""
        if not self.pending:
            return False
        values = torch.cat([v for *_, v in self.pending])  # (2 x steps,): [loss, grad norm] of each, in order
        got = read(values) if read is not None else host_read(values, trainer.mesh)
        pending, self.pending = self.pending, []  # after the read: a failed one leaves them unchecked (nothing saved)
        losses = got[0::2]
        for i, ((step, first, end, _), loss_v, gnorm_v) in enumerate(zip(pending, losses, got[1::2])):
            reason = self.spikes.verdict(loss_v, gnorm_v)
            if reason is None and self.spikes.spike(loss_v) is not None:
                after = losses[i + 1:i + 4]
                if not after and may_wait:
                    self.pending = pending[i:]  # judged at the next check point, with the steps after it
                    return False
                reason = self.judge(trainer, step, loss_v, after)
            if reason is not None:
                self.undo(trainer, reason, step, first, end)
                return True
            self.spikes.add(step, loss_v)
            if self.first is not None and self.first[0] == step:  # a reference newer than the last check's
                self.spikes.refer(step, loss_v, self.first[1], copy=False)
        if self.latest is not None and self.latest[0] == pending[-1][0]:
            self.spikes.refer(pending[-1][0], losses[-1], self.latest[1])
        return False

    def verdict(self, loss: float, gnorm: float) -> str | None:
        """Why a step with this loss and gradient norm is bad whatever follows it, or for a loss spike, or None."""
        return self.spikes.verdict(loss, gnorm) or self.spikes.spike(loss)

    def judge(self, trainer, step: int, loss: float, after: list[float]) -> str | None:
        """The verdict on a spike at `step` given the losses of the steps after it (kiln.train.spikes): the
        reason it is bad, or None for a change of data (noticed; the window starts again)."""
        if after and not self.spikes.persists(after):
            return self.spikes.spike(loss) + f"; the steps after it are back to {min(after):.4f}: one bad batch"
        reason = self.spikes.broken(trainer, loss)
        if reason is None:
            trainer.notice("data_shift", **self.spikes.shift(step, loss, trainer))
        return reason

    def undo(self, trainer, reason: str, step: int, first: int, end: int) -> None:
        """Restore the newest snapshot and pass over the samples [first, end) of bad step `step` from now on."""
        recent = [b for b in self.bad if b[0] > step - self.rcfg.rollback_window]
        stop = len(recent) >= self.rcfg.max_rollbacks
        skipped, scale, bad = list(trainer.skips.ranges), trainer.lr_scale, list(self.bad)
        restored = self.restore(trainer, step)
        for r in [*skipped, (first, end, step)]:  # the restore brought back the snapshot's older list and scale
            trainer.skips.add(*r)
        self.bad = [*bad, (step, first, end)]
        self.spikes.forget_after(restored)
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
                f"indices, in the loader's order) - {listing}. " + (
                    f"The state of step {restored}, the last good one, is saved as an emergency checkpoint (with "
                    "checkpoint.on_signal on; it passes over these samples when resumed). Check those samples in the "
                    "data, lower train.lr or raise train.warmup_steps, then resume" if restored else
                    "The good state rolled back to is the start (step 0), which is no checkpoint: nothing is saved, "
                    "and a start again meets these samples first. Check them in the data, lower train.lr or raise "
                    "train.warmup_steps (or recovery.max_loss), then start again"))
            err.emergency = True
            raise err

    def restore(self, trainer, bad_step: int) -> int:
        """Go back to the newest good state before `bad_step`: a complete checkpoint on disk newer than the
        snapshot (loaded, then snapshotted), else the snapshot. Returns its step."""
        snap = self.snapshots.snapshot
        newer = self.newer_checkpoint(snap.step if snap is not None else -1, bad_step)
        if newer is None:
            return self.snapshots.restore(self._parts(trainer))
        self.checkpointer.load(trainer, newer)  # its files verified first
        self.snapshots.take(trainer_parts(trainer))  # a step after the first: the optimizer has its moments
        return trainer.step

    def newer_checkpoint(self, after: int, before: int):
        """The newest complete checkpoint of the run with a step in (after, before), or None; rank 0's answer."""
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()  # a save still being written completes first
        found = None
        if self.checkpointer.rank == 0:
            found = next((p for p in reversed(checkpoints(self.checkpointer.run_dir))
                          if after < step_of(p) < before), None)
        return from_rank0(found, self.checkpointer.control_group)

    def _parts(self, trainer):
        parts = trainer_parts(trainer)
        snap = self.snapshots.snapshot
        if snap is not None and not snap.tensors.get("optim"):
            parts["optim"] = _FreshOptimizer(trainer.optimizer)
        return parts
