"""Weighted mixtures: proportions, sources as a function of (seed, index), resume and ranks."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.data.load.loader import PackedLoader
from kiln.data.load.mixture import Mixture
from kiln.errors import ConfigError

from ..conftest import make_stream

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


def _texts(tmp_path, name, modules):
    d = tmp_path / name
    d.mkdir()
    lines = [ln.strip() for m in modules for ln in (m.__doc__ or "").splitlines() if len(ln.strip()) > 10]
    (d / "docs.txt").write_text("\n".join(f"{name} {i}: {ln}" for i, ln in enumerate(lines * 4)))
    return d


def test_mixture_from_the_run_config(tmp_path):
    """data.mixture through build_data: real prepared datasets, one tokenizer, weights honoured,
    a prepared directory as an entry, and a dataset of another tokenizer refused."""
    import argparse
    import collections
    import json as json_mod
    import pathlib
    import typing

    import torch

    from kiln.config import load_config
    from kiln.data.build import build_data
    from kiln.data.prepare.pipeline import prepare
    from kiln.errors import DataError

    a = _texts(tmp_path, "alpha", (collections, json_mod, argparse))
    b = _texts(tmp_path, "beta", (pathlib, typing))
    common = ["data.text_unit=line", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1",
              "data.val_fraction=0.2", "train.seq_len=16", "train.batch_size=8"]
    cfg = load_config(None, [f"data.mixture=[{{sources: [{a}], weight: 3}}, {{sources: [{b}], weight: 1}}]", *common])
    data = build_data(cfg, torch.device("cpu"), rank=0, world=1)
    first, second = data.datasets
    assert first.tokenizer.hash == second.tokenizer.hash
    for _ in range(50):
        tokens, targets, doc_ids = next(data.train)
    taken = data.train.state_dict()["taken"]
    assert abs(taken[f"{first.id}/train"] / 400 - 0.75) < 0.02
    assert data.manifest["id"].startswith("mix-") and next(data.val)[0].shape == (8, 16)
    data.train.close()

    by_dir = load_config(None, [f"data.mixture=[{{dataset: {first.path}}}, {{sources: [{b}], weight: 0.5}}]", *common])
    again = build_data(by_dir, torch.device("cpu"), rank=0, world=1)
    assert [ds.id for ds in again.datasets] == [first.id, second.id]  # the same content-addressed datasets
    again.train.close()

    other = prepare(load_config(None, [f"data.sources=[{b}]", *common, "data.vocab_size=280"]).data)
    wrong = load_config(None, [f"data.mixture=[{{sources: [{a}]}}, {{dataset: {other.path}}}]", *common])
    with pytest.raises(DataError, match=r"data.mixture\[1\].*tokenizer"):
        build_data(wrong, torch.device("cpu"), rank=0, world=1)
