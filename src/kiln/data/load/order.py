"""Seeded orders computed per index, in O(1) memory: a random permutation of [0, n).

`permute(i, n, key)` maps indices through a keyed Feistel network on the smallest even-bit power
of two >= n and walks cycles back into range, so it is a bijection of [0, n) that never needs the
whole permutation in memory: a dataset of 10^11 tokens costs nothing more to shuffle than a small
one, and the order of sample i is a pure function of (key, i).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrap-around arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def round_keys(*key: int) -> np.ndarray:
    """ROUNDS uint64 keys derived from integers (seed, stream, epoch, ...)."""
    return np.random.SeedSequence([int(k) & 0xFFFFFFFFFFFFFFFF for k in key]).generate_state(ROUNDS, np.uint64)


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask, h = np.uint64((1 << half) - 1), np.uint64(half)
    left, right = x >> h, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << h) | right


def permute(i: np.ndarray | int, n: int, keys: np.ndarray) -> np.ndarray:
    """Image of indices `i` (each in [0, n)) under the permutation of [0, n) that `keys` selects."""
    if n <= 0:
        raise ValueError("permute: n must be positive")
    x = np.atleast_1d(np.asarray(i, dtype=np.uint64)).copy()
    bits = max(2, int(n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    x = _feistel(x, half, keys)
    out = x >= n
    while out.any():  # cycle walking: at most a few rounds, as the domain is < 4n
        x[out] = _feistel(x[out], half, keys)
        out = x >= n
    return x.astype(np.int64)
