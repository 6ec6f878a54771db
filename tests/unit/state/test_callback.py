"""kiln.state.callback: the checkpoint cadence of a run, and checkpoint.at_end (no checkpoint when training ends)."""

from __future__ import annotations

import pytest

from kiln.config import RunConfig
from kiln.state.callback import CheckpointEvery
from kiln.state.checkpointer import Checkpointer
from kiln.state.rundir import checkpoints

from .conftest import PRINTS, run_steps


@pytest.mark.parametrize("at_end", [True, False])
def test_the_end_of_training_writes_a_checkpoint_unless_at_end_is_false(trainer_factory, at_end):
    t = trainer_factory(every=4, async_save=True, at_end=at_end, save_final=at_end)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, lambda m: None)
    cadence = CheckpointEvery(ck)
    for _ in range(6):
        run_steps(t, 1)
        cadence.on_step_end(t, None)
    cadence.on_train_end(t, {})
    steps = [int(p.name.split("_")[-1]) for p in checkpoints(t.cfg.train.run_dir)]
    assert sorted(steps) == ([4, 6] if at_end else [4])  # the periodic one complete either way
    ck.close()


def test_at_end_false_needs_save_final_false():
    with pytest.raises(ValueError, match="set checkpoint.save_final=false too"):
        RunConfig.model_validate({"checkpoint": {"at_end": False}})
    assert not RunConfig.model_validate({"checkpoint": {"at_end": False, "save_final": False}}).checkpoint.at_end
