"""The archive as a background policy: an outage never stops training, missed checkpoints follow when it
comes back (in the same process or the next), and a resume with no good local checkpoint takes the
newest verified archive copy.

The outage is real: the archive directory is replaced by a regular file, so every copy fails with
NotADirectoryError / FileExistsError. (A read-only chmod would not do: the tests run as root, which
ignores permission bits; a file where a directory should be stops root too.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.errors import StateError
from kiln.state.archive import Archive
from kiln.state.archiver import Archiver
from kiln.state.callback import CheckpointEvery
from kiln.state.checkpointer import Checkpointer
from kiln.state.resume import resume_target
from kiln.state.rundir import checkpoints
from kiln.state.verify import verify
from kiln.train.events import Callback

from .conftest import PRINTS, run_steps


class Outage:
    def __init__(self, root: Path):
        self.root, self.saved = root, root.with_name(root.name + ".away")

    def begin(self):
        self.root.rename(self.saved)
        self.root.write_text("not a directory")

    def end(self):
        self.root.unlink()
        self.saved.rename(self.root)


class BreakArchiveAt(Callback):
    def __init__(self, step: int, ck: Checkpointer, outage: Outage):
        self.step, self.ck, self.outage = step, ck, outage

    def on_step_end(self, trainer, metrics):
        if trainer.step == self.step:
            self.ck.wait()
            assert archiver(self.ck).flush()  # what was queued before the outage is archived
            self.outage.begin()


def archiver(ck: Checkpointer) -> Archiver:
    return next(p for p in ck.policies if isinstance(p, Archiver))


def short_run(trainer_factory, tmp_path, **ckpt):
    t = trainer_factory(**{"every": 2, "archive_url": str(tmp_path / "archive"), "archive_every": 1,
                           "archive_best": False, "keep_last": 1, **ckpt})
    t.cfg = t.cfg.model_copy(update={"train": t.cfg.train.model_copy(update={"max_steps": 7})})
    t.val_loader = None  # no evaluation: only the checkpoints matter here
    return t


def test_an_archive_outage_does_not_stop_training_and_missed_checkpoints_follow(trainer_factory, tmp_path):
    t = short_run(trainer_factory, tmp_path, async_save=True)
    logs = []
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, logs.append)
    outage = Outage(tmp_path / "archive")
    (tmp_path / "archive").mkdir()
    t.events.callbacks = [BreakArchiveAt(3, ck, outage), CheckpointEvery(ck)]
    t.train()  # checkpoints at 2 (archived), then 4, 6 and the final 7 while the archive is down
    ck.wait()
    assert t.step == 7
    assert not archiver(ck).flush()
    failures = [m for m in logs if "failed" in m and "training goes on" in m]
    assert len(failures) == 1  # one message per outage, not one per retry
    # kept locally until archived, though keep_last=1
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000004", "step_00000006", "step_00000007"]
    outage.end()
    ck.close()  # the archive is back: the queue goes out
    arch = Archive(str(tmp_path / "archive"), "run")
    assert arch.list() == ["step_00000002", "step_00000004", "step_00000006", "step_00000007"]
    assert all(verify(tmp_path / "archive" / "run" / n) == [] for n in arch.list())
    assert any("works again" in m for m in logs)


def test_checkpoints_missed_by_an_earlier_process_are_archived_by_the_next(trainer_factory, tmp_path):
    t = short_run(trainer_factory, tmp_path, async_save=False)
    logs = []
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, logs.append)
    outage = Outage(tmp_path / "archive")
    (tmp_path / "archive").mkdir()
    outage.begin()
    for _ in range(2):
        run_steps(t, 2)
        ck.save(t)
    ck.close()  # the last attempt fails: named, kept locally
    assert any("not archived" in m and "step_00000004" in m for m in logs)
    outage.end()
    later = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, logs.append)  # e.g. the resume of this run
    later.close()
    assert Archive(str(tmp_path / "archive"), "run").list() == ["step_00000002", "step_00000004"]


def test_backoff_doubles_up_to_its_limit(tmp_path):
    (tmp_path / "archive").write_text("not a directory")
    from kiln.config import CheckpointConfig

    a = Archiver(Archive(str(tmp_path / "archive"), "run"), tmp_path / "run", CheckpointConfig(), print,
                 base_delay=5, max_delay=30, background=False)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    a.after_save(ckpt, {"reason": "final", "step": 2})
    delays = []
    for _ in range(5):
        assert not a.flush()
        delays.append(a._delay())
    assert delays == [5, 10, 20, 30, 30]


def test_resume_takes_the_newest_verified_archive_copy_when_no_local_one_is_good(trainer_factory, tmp_path):
    t = short_run(trainer_factory, tmp_path, async_save=False, keep_last=3)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    for _ in range(3):
        run_steps(t, 2)
        ck.save(t)
    ck.close()
    run_dir = Path(t.cfg.train.run_dir)
    for p in checkpoints(run_dir):
        (p / ".metadata").write_bytes(b"x")  # every local checkpoint damaged
    newest = tmp_path / "archive" / "run" / "step_00000006" / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[:-1] + b"!")  # and the newest archive copy too
    logs = []
    chosen_dir, chosen = resume_target(t.cfg, "auto", logs.append)
    assert chosen == run_dir / "checkpoints" / "step_00000004" and verify(chosen) == []
    assert any("skipping archive copy step_00000006" in m for m in logs)
    assert any("fetched step_00000004 from the archive" in m for m in logs)
    assert (run_dir / "checkpoints" / ".damaged-step_00000004").is_dir()  # the local one, set aside
    fresh = trainer_factory()
    assert Checkpointer(run_dir, fresh.cfg, PRINTS, print).load(fresh, chosen)["step"] == 4

    shutil.rmtree(run_dir)  # the whole run directory gone: the archive still has it
    assert resume_target(t.cfg, "auto", print)[1] == run_dir / "checkpoints" / "step_00000004"


def test_without_an_archive_all_damaged_is_still_an_error(trainer_factory, tmp_path):
    t = short_run(trainer_factory, tmp_path, async_save=False)
    t.cfg = t.cfg.model_copy(update={"checkpoint": t.cfg.checkpoint.model_copy(update={"archive_url": None})})
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    run_steps(t, 2)
    (ck.save(t) / ".metadata").write_bytes(b"x")
    ck.close()
    with pytest.raises(StateError, match="every checkpoint .* is damaged"):
        resume_target(t.cfg, "auto", print)
