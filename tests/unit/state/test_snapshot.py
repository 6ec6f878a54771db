"""The memory tier: a snapshot restored into a trainer that trained on is exactly the state it was taken from."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from kiln.errors import StateError
from kiln.state.snapshot import MemorySnapshots

from .conftest import run_steps


def _state(t):
    return {
        "weights": {k: v.detach().clone() for k, v in t.model.state_dict().items()},
        "optim": copy.deepcopy(t.optimizer.state_dict()["state"]),
        "lr": [g["lr"] for g in t.optimizer.param_groups],
        "scheduler": {k: v for k, v in t.scheduler.state_dict().items() if k != "lr_lambdas"},
        "loader": t.train_loader.state_dict(),
        "trainer": t.state_dict(),
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_restore_brings_back_every_part_after_training_further(trainer_factory):
    t = trainer_factory()
    run_steps(t, 3)
    t.last_eval = {"step": 3, "val_loss": 4.5, "val_ppl": 90.0}
    snaps = MemorySnapshots()
    assert snaps.take(t).step == 3
    before = _state(t)
    draws = (random.random(), np.random.rand(), torch.rand(2))  # what the generators give after the snapshot
    expected = run_steps(t, 4)  # training goes on: every part moves
    t.last_eval = {"step": 7, "val_loss": 3.0, "val_ppl": 20.0}
    after = _state(t)
    for key in before:
        assert not _equal(before[key], after[key]), f"{key} did not change while training"

    assert snaps.restore(t) == 3
    restored = _state(t)
    for key in before:
        assert _equal(before[key], restored[key]), key
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert again[:2] == draws[:2] and torch.equal(again[2], draws[2])
    assert run_steps(t, 4) == expected  # and the run continues exactly as it did from there


def test_a_snapshot_survives_its_restore_and_shares_no_memory(trainer_factory):
    t = trainer_factory()
    run_steps(t, 2)
    snaps = MemorySnapshots()
    snaps.take(t)
    expected = run_steps(t, 2)
    snaps.restore(t)
    assert run_steps(t, 2) == expected  # the training after the restore did not write into the snapshot
    assert snaps.restore(t) == 2 and run_steps(t, 2) == expected


def test_restore_without_a_snapshot_says_how_to_get_one(trainer_factory):
    with pytest.raises(StateError, match="snapshot_every"):
        MemorySnapshots().restore(trainer_factory())
