"""kiln.state.dcp_read: a part of a checkpoint is read whole, or refused naming what differs."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import StateError
from kiln.state.dcp_read import read_part

from .conftest import saved_checkpoints


def test_a_part_reads_whole_and_equal(trainer_factory):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    want = trainer.model.state_dict()
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    read_part(ckpt, "model", state)
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def test_names_that_differ_are_refused_not_left_as_allocated(trainer_factory):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    names = list(trainer.model.state_dict())
    with pytest.raises(StateError, match=r"1 of the 1 tensors expected are not in it .*layers\.9\.w"):
        read_part(ckpt, "model", {"layers.9.w": torch.zeros(2)})  # nothing of it in the checkpoint
    fewer = {k: torch.zeros_like(v) for k, v in list(trainer.model.state_dict().items())[1:]}
    with pytest.raises(StateError, match=f"holds 1 tensors not expected .*{names[0]}"):
        read_part(ckpt, "model", fewer)
    assert all(not v.any() for v in fewer.values())  # nothing was read into it


def test_an_optional_name_may_be_missing(trainer_factory):
    trainer, (ckpt,) = saved_checkpoints(trainer_factory, 1)
    state = {k: torch.zeros_like(v) for k, v in trainer.model.state_dict().items()}
    state["extra.weight"] = torch.zeros(3)
    read_part(ckpt, "model", state, optional=frozenset({"extra.weight"}))
    assert "extra.weight" not in state
