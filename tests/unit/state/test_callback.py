"""kiln.state.callback: the checkpoint cadence of a run, and checkpoint.at_end (no checkpoint when training ends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.config import RunConfig
from kiln.monitor.sinks.logfile import LogFileSink
from kiln.state.callback import CheckpointEvery
from kiln.state.checkpointer import Checkpointer
from kiln.state.rundir import checkpoints

from .conftest import PRINTS, run_steps


@pytest.mark.parametrize("at_end", [True, False])
def test_the_end_of_training_writes_a_checkpoint_unless_at_end_is_false(trainer_factory, at_end):
    t = trainer_factory(every=4, async_save=True, at_end=at_end, save_final=at_end)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, lambda m: None)
    cadence = CheckpointEvery(ck)
    log = Path(t.cfg.train.run_dir) / "train.log"
    sink = LogFileSink(log)
    t.events.callbacks.append(sink)
    for _ in range(6):
        run_steps(t, 1)
        cadence.on_step_end(t, None)
    cadence.on_train_end(t, {})
    steps = [int(p.name.split("_")[-1]) for p in checkpoints(t.cfg.train.run_dir)]
    assert sorted(steps) == ([4, 6] if at_end else [4])  # the periodic one complete either way
    # each complete save is a line of train.log (it said nothing of them: where could the run resume from?)
    said = [line[21:] for line in log.read_text().splitlines()]
    assert [s.split(" (")[0] for s in said if s.startswith("checkpoint:")] == \
        ["checkpoint: step_00000004 saved"] + (["checkpoint: step_00000006 saved"] if at_end else [])
    assert any(s.startswith("checkpoint: step_00000004 saved (periodic, ") and s.endswith(" s)") for s in said)
    sink.on_run_end(t, "finished")  # closes train.log
    ck.close()


def test_at_end_false_needs_save_final_false():
    with pytest.raises(ValueError, match="set checkpoint.save_final=false too"):
        RunConfig.model_validate({"checkpoint": {"at_end": False}})
    assert not RunConfig.model_validate({"checkpoint": {"at_end": False, "save_final": False}}).checkpoint.at_end
