"""Curricula: mixture weights that change during the run, as a pure function of the global sample index.

A schedule is a list of stages, each beginning at a global sample with weights over the datasets.
Between two stages the weights hold the earlier stage's, or, when the later stage blends, move
linearly from the earlier stage's to the later one's (a ramp over the samples in between). Sample g
is drawn as in a fixed mixture (kiln.data.load.mixture): x_g on the seeded Weyl sequence, compared
with the cumulative weights in force at g. So the dataset of every sample, and the count the loader
keeps of each, depends on (seed, schedule, g) alone: a resume continues exactly across a stage
boundary and on any number of ranks. A one-stage schedule draws what the fixed mixture of its weights
draws. Steps and token counts become sample indices in `stages_in_samples`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kiln.data.load.mixture import Mixture, weyl_offset, weyl_points
from kiln.errors import ConfigError
from kiln.events import Callback

_TOP = 2.0**64 - 2048  # the largest float64 below 2^64: upper bound of an edge on the circle


@dataclass(frozen=True)
class Stage:
    """From global sample `start` on, draw with `weights`; `blend`: reach them linearly from the
    previous stage's weights over the samples since the previous stage began."""

    start: int
    weights: tuple[float, ...]
    blend: bool = False


class Schedule:
    """Assigns global sample indices to datasets by the weights of the stage in force."""

    def __init__(self, stages: Sequence[Stage], seed: int):
        if not stages or stages[0].start != 0:
            raise ConfigError("data.schedule: the first stage must begin at 0")
        k = len(stages[0].weights)
        for prev, st in zip(stages, stages[1:]):
            if st.start <= prev.start:
                raise ConfigError(f"data.schedule: stages must begin at increasing samples, got {prev.start} then "
                                  f"{st.start} (two stages within one step or one row of tokens?)")
        if any(len(st.weights) != k for st in stages):
            raise ConfigError("data.schedule: every stage needs one weight per dataset")
        self.stages = list(stages)
        self._fixed = [Mixture(st.weights, seed) for st in stages]  # checks the weights; normalises them
        self._offset = weyl_offset(seed)

    def __len__(self) -> int:
        return len(self._fixed[0])

    def weights_at(self, g: int) -> np.ndarray:
        """The normalised weights in force at global sample g."""
        j = self._stage_of(g)
        if j + 1 < len(self.stages) and self.stages[j + 1].blend:
            return self._ramp(j, np.array([g]))[0]
        return self._fixed[j].weights

    def _stage_of(self, g: int) -> int:
        return max(i for i, st in enumerate(self.stages) if st.start <= g)

    def _ramp(self, j: int, g: np.ndarray) -> np.ndarray:
        """Weights (len(g), datasets) on the ramp from stage j to stage j + 1."""
        lo, hi = self.stages[j].start, self.stages[j + 1].start
        a = ((g - lo) / (hi - lo))[:, None]
        return (1 - a) * self._fixed[j].weights + a * self._fixed[j + 1].weights

    def sources(self, start: int, n: int) -> np.ndarray:
        """Dataset index of global samples start .. start+n-1, as an int64 array of length n."""
        out = np.empty(n, dtype=np.int64)
        g, end = start, start + n
        while g < end:
            j = self._stage_of(g)
            stop = min(end, self.stages[j + 1].start) if j + 1 < len(self.stages) else end
            sl = slice(g - start, stop - start)
            if j + 1 < len(self.stages) and self.stages[j + 1].blend:
                out[sl] = self._ramped(j, g, stop - g)
            else:
                out[sl] = self._fixed[j].sources(g, stop - g)
            g = stop
        return out

    def _ramped(self, j: int, start: int, n: int) -> np.ndarray:
        w = self._ramp(j, np.arange(start, start + n, dtype=np.float64))  # (n, K)
        edges = np.minimum(np.cumsum(w, axis=1)[:, :-1] * 2.0**64, _TOP).astype(np.uint64)  # (n, K-1)
        x = weyl_points(self._offset, start, n)
        src = (x[:, None] >= edges).sum(axis=1)
        last = w.shape[1] - 1 - np.argmax(w[:, ::-1] > 0, axis=1)  # a dataset of weight zero is never drawn
        return np.minimum(src, last).astype(np.int64)


def stages_in_samples(stages, unit: str, seq_len: int, samples_per_step: int) -> list[Stage]:
    """Config stages (`at` in steps or tokens) as Stages beginning at global sample indices: step s
    begins at sample s x samples_per_step (the global batch of one optimizer step); a token count t at
    the first sample after t tokens of targets, ceil(t / seq_len)."""
    out = []
    for st in stages:
        start = st.at * samples_per_step if unit == "steps" else math.ceil(st.at / seq_len)
        out.append(Stage(int(start), tuple(float(w) for w in st.weights), bool(st.blend)))
    return out


class ScheduleLog(Callback):
    """Adds the weights in force (`mix/0`, `mix/1`, ...: data.mixture's entries, in order) to each logging
    step's metrics, before the sinks see them: a curriculum's stages show in metrics.jsonl and every sink."""

    def __init__(self, loader):
        self.loader = loader

    def on_step_end(self, trainer, metrics: dict | None) -> None:
        schedule = getattr(getattr(self.loader, "rows", None), "mixture", None)
        if metrics is None or not isinstance(schedule, Schedule):
            return
        weights = schedule.weights_at(max(0, int(self.loader.state_dict()["sample"]) - 1))  # the last sample's
        metrics.update({f"mix/{i}": round(float(w), 6) for i, w in enumerate(weights)})
