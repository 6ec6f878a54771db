"""checkpoint.keep_best: the checkpoint with the lowest validation loss survives keep_last, also across a
restart of the checkpointer (a resume)."""

from __future__ import annotations

from kiln.state.checkpointer import Checkpointer
from kiln.state.rundir import checkpoints

from .conftest import PRINTS, run_steps


def save_with_losses(t, ck, losses):
    for loss in losses:
        run_steps(t, 1)
        t.last_eval = {"step": t.step, "val_loss": loss}  # an evaluation at the checkpoint's step
        ck.save(t)


def test_the_best_checkpoint_outlives_keep_last(trainer_factory):
    t = trainer_factory(keep_last=1)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, lambda m: None)
    save_with_losses(t, ck, [3.0, 1.0, 2.0, 2.5])
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000002", "step_00000004"]
    ck.close()
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, lambda m: None)  # a resume knows the best on disk
    save_with_losses(t, ck, [2.2])
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000002", "step_00000005"]
    save_with_losses(t, ck, [0.5, 0.9])  # a new best: the old one goes
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000006", "step_00000007"]
    ck.close()


def test_keep_best_off_keeps_only_the_newest(trainer_factory):
    t = trainer_factory(keep_last=1, keep_best=False)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, lambda m: None)
    save_with_losses(t, ck, [3.0, 1.0, 2.0])
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000003"]
    ck.close()
