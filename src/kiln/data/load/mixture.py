"""Weighted mixtures: which dataset each global sample comes from, as a pure function of (seed, index).

Sample g is drawn from the dataset whose slice of [0, 1) holds x_g = frac(u + g / phi), with u a
seeded offset and phi the golden ratio (a Weyl sequence, in exact 64-bit integer arithmetic). Over
any n consecutive samples every dataset's share is within O(log n) samples of n * weight, far
tighter than independent draws (whose error grows like sqrt(n)), and every micro-batch holds a
steady mix. Within a dataset, samples are taken in that dataset's own seeded order; the loader
counts how many it has taken from each. A weight may be zero (a curriculum's stage that leaves a dataset
out, kiln.data.load.schedule): that dataset is never drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.errors import ConfigError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / phi, odd


class Mixture:
    """Assigns global sample indices to datasets in proportion to `weights`."""

    def __init__(self, weights: Sequence[float], seed: int):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
            raise ConfigError(f"data.mixture weights must be positive numbers, got {list(weights)}")
        self.weights = w / w.sum()
        cum = np.cumsum(self.weights)[:-1]
        # thresholds on the 2^64 circle; sample g goes to the first dataset whose upper edge exceeds x_g
        self._edges = np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cum], dtype=np.uint64)
        self._last = int(np.nonzero(w > 0)[0][-1])  # trailing zero weights: their edges may round below 2^64
        self._offset = weyl_offset(seed)

    def __len__(self) -> int:
        return self.weights.size

    def sources(self, start: int, n: int) -> np.ndarray:
        """Dataset index of global samples start .. start+n-1, as an int64 array of length n."""
        x = weyl_points(self._offset, start, n)
        if not self._edges.size:
            return np.zeros(n, dtype=np.int64)
        return np.minimum(np.searchsorted(self._edges, x, side="right"), self._last).astype(np.int64)


def weyl_offset(seed: int) -> np.uint64:
    """The seeded start of the Weyl sequence."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, 0x6D6978])
    return ss.generate_state(1, np.uint64)[0]


def weyl_points(offset: np.uint64, start: int, n: int) -> np.ndarray:
    """x_g on the 2^64 circle (uint64) of global samples start .. start+n-1."""
    g = np.arange(start, start + n, dtype=np.uint64)
    return offset + g * _GOLDEN  # wraps modulo 2^64
