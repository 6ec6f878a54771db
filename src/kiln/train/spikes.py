"""Which steps are bad: the detector behind kiln.train.rollback, and what tells a divergence from a change of data.

A step is bad at once when its loss or gradient norm is not finite, or when its loss is above an absolute bound
(`recovery.max_loss`; by default twice the loss of a uniform guess over the vocabulary, 2 ln V): a bound that
holds from the first step, before the spike window has filled, and after a forced resume at a rate that
diverges.

A loss more than `recovery.spike_zscore` standard deviations above the mean of the last `recovery.spike_window`
good steps, and at least `recovery.spike_min_rise` above it (a model that knows its data by heart has a window
so flat that any rise is many deviations), is a spike, and a spike is not by itself a divergence: the data can
change under a valid run (a stream that moves from repetitive records to prose, a mixture whose sources differ in
difficulty). The steps after it tell which it is:
- the loss is back to its level at the steps after it: one bad batch. The step is rolled back and its samples
  passed over.
- the rise persists over the steps after it: the data changed, or the weights broke. The model's loss on a
  batch it trained on before the spike (the reference: the newest good step before it whose batch was kept, the
  last of the previous check or the first noted since) is measured again with the weights of now. Broken
  weights do worse on it, by more than half of the spike's rise: a divergence, rolled back. Weights that still
  know that batch met harder data: a shift, which training goes on through (an `on_notice` "data_shift"); the
  spike window starts again from the new level.
The gradient norm is no help there: at a shift to harder data it jumps as at a divergence (58 times its median,
measured on a stream of repetitive records then prose, against 800 times for a batch that overflows).

A spike at the last step noted so far has no steps after it yet: its verdict waits for the next check point,
unless the state is about to be kept (a snapshot, a checkpoint, an evaluation, the end), where only the
reference decides (broken weights are rolled back; weights that are not broken are kept).

The window (the good steps' losses) and the rollbacks so far are the detector's state, saved with the run's
counters in every checkpoint and snapshot (`Rollback.state_key`), so a resumed run judges its first steps as
the uninterrupted run would have.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kiln.config import RecoveryConfig
from kiln.parallel.parallelize import reduce_mean


def loss_bound(rcfg: RecoveryConfig, vocab_size: int | None) -> float | None:
    """recovery.max_loss, or twice the loss of a uniform guess over `vocab_size` tokens (None: no bound)."""
    if rcfg.max_loss is not None:
        return rcfg.max_loss
    return 2 * math.log(vocab_size) if vocab_size and vocab_size > 1 else None


@dataclass
class Reference:
    """A batch trained on at a good step, and its loss then (the mean over ranks, before that step's update)."""

    step: int
    loss: float
    batch: tuple  # this rank's rows: (tokens, targets, doc_ids or None), on the device


@torch.no_grad()
def batch_loss(trainer, batch: tuple) -> float:
    """The mean over ranks of the model's loss on each rank's rows of `batch`, with its weights of now."""
    x, y, docs = batch
    n, total = len(x), torch.zeros((), device=trainer.device)
    with trainer.meter.paused():  # not training time
        for lo in range(0, n, trainer.micro):
            hi = min(lo + trainer.micro, n)
            with trainer.autocast():
                total += trainer.model(x[lo:hi], y[lo:hi], None if docs is None else docs[lo:hi]).float() * (
                    (hi - lo) / n)
        return reduce_mean(total[None], trainer.mesh).tolist()[0]  # kiln.parallel: the same on every rank


class SpikeDetector:
    """The verdicts of the module doc, over the good steps' losses; `state_dict` is what a resume needs."""

    def __init__(self, rcfg: RecoveryConfig, bound: float | None = None):
        self.z, self.size, self.bound = rcfg.spike_zscore, rcfg.spike_window, bound
        self.min_rise = rcfg.spike_min_rise
        self.window: deque[tuple[int, float]] = deque(maxlen=self.size)  # (step, loss) of good steps
        self.reference: Reference | None = None
        self.asked: tuple[int, float, float] | None = None  # the reference's step, loss then and now, once asked

    def add(self, step: int, loss: float) -> None:
        self.window.append((step, loss))

    def forget_after(self, step: int) -> None:
        """Drop what was learnt after `step` (the state is back there)."""
        self.window = deque(((s, v) for s, v in self.window if s <= step), maxlen=self.size)
        if self.reference is not None and self.reference.step > step:
            self.reference = None

    def refer(self, step: int, loss: float, batch: tuple | None, copy: bool = True) -> None:
        """Make the batch of good step `step` the reference (copied unless `copy` is off: a loader may reuse its
        buffers)."""
        if batch is not None:
            self.reference = Reference(step, loss, tuple(t if t is None or not copy else t.clone() for t in batch))

    def stats(self) -> tuple[float, float]:
        values = [v for _, v in self.window]
        mean = sum(values) / len(values)
        return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))

    def verdict(self, loss: float, gnorm: float) -> str | None:
        """Why a step is bad whatever follows it (a non-finite value, a loss above the bound), or None."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(gnorm):
            return f"gradient norm is {gnorm}"
        if self.bound is not None and loss > self.bound:
            return (f"loss {loss:.4f} is above recovery.max_loss={self.bound:.4g} (a uniform guess over the "
                    f"vocabulary scores about half of that by default)")
        return None

    def score(self, loss: float) -> float | None:
        """How many standard deviations `loss` is above the window's mean (None: no full window, or spikes off);
        0 for a rise under recovery.spike_min_rise."""
        if not self.z or len(self.window) < self.size:
            return None
        mean, sd = self.stats()
        if loss - mean < self.min_rise:
            return 0.0
        return (loss - mean) / max(sd, 1e-6 * abs(mean), 1e-12)

    def spike(self, loss: float) -> str | None:
        """The reason a loss is a spike against the window, or None."""
        score = self.score(loss)
        if score is None or score <= self.z:
            return None
        mean, _ = self.stats()
        return (f"loss spike: {loss:.4f} is {score:.1f} standard deviations above the mean {mean:.4f} of the last "
                f"{self.size} steps (recovery.spike_zscore={self.z:g})")

    def persists(self, after: list[float]) -> bool:
        """Whether the losses of the steps after a spike are still a spike (their median, against the window)."""
        score = self.score(statistics.median(after))
        return score is not None and score > self.z

    def broken(self, trainer, loss: float) -> str | None:
        """After a spike to `loss` that persists: why the weights are broken (the reference batch's loss rose by
        more than half the spike's rise), or None (they still know it, or there is no reference to ask)."""
        ref = self.reference
        if ref is None:
            return None
        mean, _ = self.stats()
        now = batch_loss(trainer, ref.batch)
        self.asked = (ref.step, ref.loss, now)
        if not math.isfinite(now) or now - ref.loss > 0.5 * (loss - mean):
            return (f"divergence: the loss rose to {loss:.4f} from a mean of {mean:.4f}, and on the batch of step "
                    f"{ref.step} it is {now:.4f} now against {ref.loss:.4f} when trained: the weights broke")
        return None

    def shift(self, step: int, loss: float, trainer) -> dict[str, Any]:
        """Accept a persistent rise at `step` as a change of data: the window starts again from it."""
        mean, _ = self.stats()
        asked = self.asked if self.reference is not None else None
        info = {"step": step, "loss": loss, "previous_mean": mean,
                "message": f"the loss rose at step {step} to {loss:.4f} from a mean of {mean:.4f} and stays there, "
                           + (f"while the model still fits the batch of step {asked[0]} ({asked[2]:.4f} now, "
                              f"{asked[1]:.4f} when trained): " if asked is not None
                              else "with no earlier batch to compare: ")
                           + "taken as a change in the data, not a divergence; training goes on and the spike "
                             f"check waits for {self.size} steps at the new level"}
        self.window.clear()
        return info

    def state_dict(self) -> dict[str, Any]:
        return {"window": [list(w) for w in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = deque(((int(s), float(v)) for s, v in state.get("window", [])), maxlen=self.size)
        self.reference = None  # its batch is not saved: the first good step checked after the load is the next
