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
