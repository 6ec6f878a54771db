"""Weighted mixtures: proportions, sources as a function of (seed, index), resume and ranks."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.data.loader import PackedLoader
from kiln.data.mixture import Mixture
from kiln.errors import ConfigError

from .conftest import make_stream

T = 8
BASES = (0, 1_000_000, 2_000_000)


@pytest.fixture
def streams(tmp_path):
    """Three datasets of very different sizes; token values tell them apart (base + position + 1)."""
    sizes = ([[60] * 40], [[30] * 10], [[25, 50, 25]])
    return [make_stream(tmp_path, f"ds-{i}", s, base=b)[0] for i, (s, b) in enumerate(zip(sizes, BASES))]


def source_of(tokens: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array(BASES[1:]), tokens[:, 0], side="right")


def test_sources_are_a_function_of_seed_and_index():
    m = Mixture([3, 1], seed=5)
    whole = m.sources(0, 1000)
    np.testing.assert_array_equal(whole[400:], m.sources(400, 600))
    assert not np.array_equal(whole, Mixture([3, 1], seed=6).sources(0, 1000))
    np.testing.assert_array_equal(Mixture([1.0], seed=1).sources(10, 5), 0)


@pytest.mark.parametrize("weights", [(0.6, 0.3, 0.1), (1, 1, 1), (0.05, 0.9, 0.05)])
def test_proportions(streams, weights):
    loader = PackedLoader(streams, T, 16, weights=weights, seed=2, prefetch=0)
    rows = np.concatenate([source_of(next(loader)[0].numpy()) for _ in range(200)])  # 3200 samples
    share = np.bincount(rows, minlength=3) / rows.size
    np.testing.assert_allclose(share, np.array(weights) / sum(weights), atol=0.005)
    # every micro-batch holds a steady mix, not long runs of one source
    first = np.array([source_of(next(loader)[0].numpy()) for _ in range(50)])
    per_batch = (first == int(np.argmax(weights))).mean(axis=1)
    assert per_batch.std() < 0.2


def test_each_dataset_keeps_its_own_epoch_order(streams):
    """A small dataset drawn often runs through whole epochs: no row repeats within one."""
    loader = PackedLoader(streams, T, 16, weights=(1, 1, 1), seed=0, prefetch=0)
    small = streams[2]
    rows_per_epoch = (len(small) - 1) // T
    starts = []
    while len(starts) < rows_per_epoch:
        tokens = next(loader)[0].numpy()
        starts += (tokens[source_of(tokens) == 2, 0] - BASES[2] - 1).tolist()
    first_epoch = starts[:rows_per_epoch]
    assert len(set(first_epoch)) == rows_per_epoch
    assert loader.state_dict()["taken"]["ds-2"] >= rows_per_epoch


def test_mixture_resume_and_elastic(streams):
    kw = dict(weights=(2, 1, 1), seed=11)
    reference = [next(ld)[0] for ld in [PackedLoader(streams, T, 12, **kw)] for _ in range(10)]
    ranks = [PackedLoader(streams, T, 4, rank=r, world=3, **kw) for r in range(3)]
    got = [np.concatenate([next(ld)[0].numpy() for ld in ranks]) for _ in range(4)]
    state = ranks[1].state_dict()
    two = [PackedLoader(streams, T, 6, rank=r, world=2, **kw) for r in range(2)]
    for ld in two:
        ld.load_state_dict(state)
    got += [np.concatenate([next(ld)[0].numpy() for ld in two]) for _ in range(6)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([r.numpy() for r in reference]))


def test_changing_weights_on_resume_continues_each_dataset(streams):
    a = PackedLoader(streams, T, 8, weights=(1, 1, 1), seed=3, prefetch=0)
    for _ in range(5):
        next(a)
    state = a.state_dict()
    b = PackedLoader(streams, T, 8, weights=(1, 0.01, 0.01), seed=3, prefetch=0)
    b.load_state_dict(state)
    assert b.state_dict()["taken"] == state["taken"]
    tokens = np.concatenate([next(b)[0].numpy() for _ in range(5)])
    assert (source_of(tokens) == 0).mean() > 0.9


def test_bad_weights():
    with pytest.raises(ConfigError, match="positive"):
        Mixture([1, -1], seed=0)
    with pytest.raises(ConfigError, match="positive"):
        Mixture([], seed=0)
