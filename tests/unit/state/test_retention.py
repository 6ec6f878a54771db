"""Room for the next checkpoint: checked before a save starts, made by retention where that is safe.

The disk is the real directory with a fake capacity: free space = capacity - the bytes under the run
directory, so deleting a checkpoint really frees room."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from kiln.errors import StateError
from kiln.state.checkpointer import Checkpointer
from kiln.state.retention import size_of
from kiln.state.rundir import checkpoints, unfinished
from kiln.state.verify import verify

from .conftest import PRINTS, run_steps

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def disk(monkeypatch, tmp_path):
    """Set `disk.capacity` (bytes); shutil.disk_usage then reports what the run directory leaves free."""
    real = shutil.disk_usage

    class Disk:
        capacity = None

        def usage(self, path):
            if self.capacity is None:
                return real(path)
            used = sum(p.stat().st_size for p in (tmp_path / "run").rglob("*") if p.is_file())
            return Usage(self.capacity, used, max(self.capacity - used, 0))

    d = Disk()
    monkeypatch.setattr(shutil, "disk_usage", d.usage)
    return d


def saves(t, ck, n):
    for _ in range(n):
        run_steps(t, 1)
        ck.save(t)
    return checkpoints(t.cfg.train.run_dir)


def used(t) -> int:
    return sum(p.stat().st_size for p in (Path(t.cfg.train.run_dir) / "checkpoints").rglob("*") if p.is_file())


def test_room_is_made_from_what_retention_deletes_anyway(trainer_factory, disk):
    t = trainer_factory(keep_last=2)
    logs = []
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, logs.append)
    one, two = saves(t, ck, 2)
    size = size_of(two)
    disk.capacity = used(t) + size // 2  # the next one fits only once step 1 is gone
    run_steps(t, 1)
    three = ck.save(t)
    assert checkpoints(t.cfg.train.run_dir) == [two, three] and verify(three) == [] and verify(two) == []
    assert any("removed step_00000001" in m and "early" in m for m in logs)
    ck.close()


def test_the_newest_checkpoint_is_never_deleted_before_a_new_one_is_complete(trainer_factory, disk):
    t = trainer_factory(keep_last=1)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    (one,) = saves(t, ck, 1)
    disk.capacity = used(t) + size_of(one) // 2
    run_steps(t, 1)
    with pytest.raises(StateError) as err:
        ck.save(t)
    msg = str(err.value)
    assert msg.startswith("disk full: the checkpoint of step 2 needs about") and str(one) in msg
    assert "two checkpoints during a save" in msg and "checkpoint.keep_last" not in msg  # lowering it cannot help
    assert checkpoints(t.cfg.train.run_dir) == [one] and verify(one) == [] and unfinished(t.cfg.train.run_dir) == []
    disk.capacity = None  # room again: the run goes on
    assert ck.save(t).name == "step_00000002"
    ck.close()


def test_lowering_keep_last_is_suggested_only_when_it_frees_enough(trainer_factory, disk):
    t = trainer_factory(keep_last=3)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    found = saves(t, ck, 3)
    size = size_of(found[-1])
    disk.capacity = used(t) - size + size // 2  # after step 1 goes, still half a checkpoint short
    run_steps(t, 1)
    with pytest.raises(StateError, match="Lowering checkpoint.keep_last to 1 would free .* which is enough"):
        ck.save(t)
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000002", "step_00000003"]
    disk.capacity = used(t) - 3 * size  # nothing Kiln may delete is enough: no keep_last advice
    with pytest.raises(StateError) as err:
        ck.save(t)
    assert "checkpoint.keep_last" not in str(err.value) and "larger disk" in str(err.value)
    ck.close()


def saves_with_losses(t, ck, losses):
    for loss in losses:
        run_steps(t, 1)
        t.last_eval = {"step": t.step, "val_loss": loss}  # an evaluation at the checkpoint's step
        ck.save(t)
    return checkpoints(t.cfg.train.run_dir)


def test_keep_last_1_is_advised_with_keep_best_in_mind(trainer_factory, disk):
    """The advice 'lower checkpoint.keep_last to 1' was given while the best checkpoint was the newest; once an
    older one was the best, checkpoint.keep_best kept it beside the newest and the save failed again."""
    t = trainer_factory(keep_last=3)  # keep_best is on by default
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    found = saves_with_losses(t, ck, [3.0, 2.0, 1.0])  # improving: the best is the newest
    size = size_of(found[-1])
    disk.capacity = used(t) - size // 2  # room for two and a half checkpoints: keep_last=1 alone is not enough
    run_steps(t, 1)
    with pytest.raises(StateError) as err:
        ck.save(t)
    msg = str(err.value)
    assert "Lowering checkpoint.keep_last to 1 would free" in msg
    assert "checkpoint.keep_best keeps the best checkpoint beside the newest when the newest is not the best" in msg
    assert "set checkpoint.keep_best=false too" in msg
    ck.close()


def test_keep_last_1_is_advised_plainly_where_the_disk_holds_three_checkpoints(trainer_factory, disk):
    t = trainer_factory(keep_last=4)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    found = saves_with_losses(t, ck, [4.0, 3.0, 2.0, 1.0])
    size = size_of(found[-1])
    disk.capacity = used(t) - int(size * 0.6)  # step 1 goes early; room for three and a half checkpoints all told
    run_steps(t, 1)
    with pytest.raises(StateError) as err:
        ck.save(t)
    assert "Lowering checkpoint.keep_last to 1 would free" in str(err.value)
    assert "(also when checkpoint.keep_best keeps an older best checkpoint beside the newest)" in str(err.value)
    ck.close()


def test_the_disk_full_message_says_keep_best_holds_an_older_checkpoint(trainer_factory, disk):
    """With checkpoint.keep_last=1 the save failed again, and the message did not say why: the best checkpoint,
    an older one, was kept beside the newest."""
    t = trainer_factory(keep_last=1)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    found = saves_with_losses(t, ck, [1.0, 2.0])
    assert [p.name for p in found] == ["step_00000001", "step_00000002"]  # the best, and the newest
    disk.capacity = used(t) + size_of(found[-1]) // 2
    run_steps(t, 1)
    with pytest.raises(StateError) as err:
        ck.save(t)
    msg = str(err.value)
    assert "step_00000001 (" in msg and "is kept by checkpoint.keep_best, as the lowest validation loss so far " \
           "(1.0000), beside the newest, so the disk holds three checkpoints during a save" in msg
    assert "checkpoint.keep_best=false lets it go, which is enough" in msg
    ck.close()
