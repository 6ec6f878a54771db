"""Checkpointer: exact round trips, async staging, snapshots, retention, archive, full disk."""

from __future__ import annotations

import errno
import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import filesystem

from kiln.config import ModelConfig
from kiln.errors import StateError
from kiln.model.llama import Transformer
from kiln.state.archive import Archive
from kiln.state.checkpointer import Checkpointer
from kiln.state.rundir import checkpoints, unfinished
from kiln.state.verify import read_meta, verify

from .conftest import PRINTS, run_steps


def checkpointer(trainer, logs=None):
    return Checkpointer(trainer.cfg.train.run_dir, trainer.cfg, PRINTS, (logs if logs is not None else []).append)


def test_round_trip_continues_bit_for_bit(trainer_factory):
    a = trainer_factory()
    run_steps(a, 4)
    ck = checkpointer(a)
    path = ck.save(a)
    random.random(), np.random.rand(), torch.rand(1)  # draws after the save must be replayed after the load
    rng_after = (random.random(), np.random.rand(), torch.rand(3))
    expected = run_steps(a, 4)
    lr_expected = a.optimizer.param_groups[0]["lr"]

    b = trainer_factory()
    ck_b = checkpointer(b)
    meta = ck_b.load(b, path)
    assert meta["step"] == 4 and b.step == 4 and b.tokens_seen == a.tokens_per_step * 4
    assert b.train_loader.state_dict()["sample"] == 4 * 2
    random.random(), np.random.rand(), torch.rand(1)
    got_rng = (random.random(), np.random.rand(), torch.rand(3))
    assert got_rng[:2] == rng_after[:2] and torch.equal(got_rng[2], rng_after[2])
    assert run_steps(b, 4) == expected
    assert b.optimizer.param_groups[0]["lr"] == lr_expected
    ck.close(), ck_b.close()


def test_nothing_is_saved_before_the_first_step(trainer_factory):
    t = trainer_factory()
    ck = checkpointer(t)
    assert ck.save(t) is None and checkpoints(t.cfg.train.run_dir) == []
    assert not t.optimizer.state  # capturing the state did not create the optimizer's moments


def test_meta_lists_every_file_with_its_hash(trainer_factory):
    t = trainer_factory()
    run_steps(t, 1)
    ck = checkpointer(t)
    path = ck.save(t)
    meta = read_meta(path)
    on_disk = sorted(p.name for p in path.iterdir() if p.name not in ("meta.json", "meta.sha256"))
    assert sorted(meta["files"]) == on_disk
    assert {"state.json", "rank0.json", ".metadata"} <= set(on_disk)
    assert meta["step"] == 1 and meta["fingerprints"] == PRINTS and meta["config"]["model"]["size"] == "tiny"
    assert verify(path) == []
    ck.close()


def test_async_save_writes_the_state_of_its_step(trainer_factory):
    t = trainer_factory(async_save=True)
    run_steps(t, 2)
    ck = checkpointer(t)
    saved = {k: v.clone() for k, v in t.model.state_dict().items()}
    path = ck.save(t)
    run_steps(t, 3)  # training goes on while the background thread writes
    ck.wait()
    assert verify(path) == [] and read_meta(path)["step"] == 2
    fresh = trainer_factory()
    checkpointer(fresh).load(fresh, path)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    ck.close()


def test_snapshot_rolls_back_in_memory(trainer_factory):
    t = trainer_factory(snapshot_every=1)
    run_steps(t, 2)
    ck = checkpointer(t)
    ck.take_snapshot(t)
    expected = run_steps(t, 3)
    assert ck.restore_snapshot(t) == 2 and t.step == 2
    assert run_steps(t, 3) == expected
    assert ck.restore_snapshot(t) == 2  # the snapshot survives a restore
    assert run_steps(t, 3) == expected


def test_retention_keeps_the_newest(trainer_factory):
    t = trainer_factory(keep_last=2)
    ck = checkpointer(t)
    for _ in range(4):
        run_steps(t, 1)
        ck.save(t)
    assert [p.name for p in checkpoints(t.cfg.train.run_dir)] == ["step_00000003", "step_00000004"]
    ck.close()


def test_archive_every_mth_and_best_verified(trainer_factory, tmp_path):
    url = str(tmp_path / "archive")
    t = trainer_factory(every=1, archive_url=url, archive_every=2, keep_last=1)
    ck = checkpointer(t)
    for val in (5.0, 4.0, 4.5, 3.0):
        run_steps(t, 1)
        t.last_eval = {"step": t.step, "val_loss": val}
        ck.save(t)
    ck.close()  # the archive is copied in the background; close() lets it finish
    arch = Archive(url, "run")
    index = arch.index()
    assert arch.list() == ["step_00000002", "step_00000004"]  # step 1 was best, then replaced by 2, then 4
    assert index["best"] == "step_00000004" and arch.best_loss() == 3.0
    assert sorted(index["checkpoints"]["step_00000004"]["kept_for"]) == ["best", "every"]
    assert index["checkpoints"]["step_00000002"]["kept_for"] == ["every"]  # no longer the best
    assert verify(tmp_path / "archive" / "run" / "step_00000002") == []
    fresh = trainer_factory()
    assert checkpointer(fresh).load(fresh, tmp_path / "archive" / "run" / "step_00000002")["step"] == 2


@contextmanager
def disk_full_after(limit: int):
    """Every file write of checkpoint data fails with ENOSPC once `limit` bytes were written in all."""
    written = [0]
    original = filesystem.FileSystem.create_stream

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            written[0] += len(b)
            if written[0] > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as f:
            yield Full(f) if "w" in mode else f

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = original


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_raises_and_keeps_earlier_checkpoints(trainer_factory, async_save, capfd):
    t = trainer_factory(async_save=async_save)
    run_steps(t, 1)
    ck = checkpointer(t)
    first = ck.save(t)
    ck.wait()
    run_steps(t, 1)
    with disk_full_after(100_000), pytest.raises(StateError, match="disk full") as err:
        ck.save(t)
        ck.wait()  # an async failure surfaces here (or at the next poll)
    assert str(first) in str(err.value) and "checkpoint.keep_last" not in str(err.value)
    assert "grew past that size" in str(err.value) and "train.run_dir" in str(err.value)  # both causes, a remedy
    assert "Traceback" not in capfd.readouterr().err  # no writer-thread tracebacks before the message
    run_dir = t.cfg.train.run_dir
    assert checkpoints(run_dir) == [first] and unfinished(run_dir) == [] and verify(first) == []
    ck.close()


def test_load_rejects_a_model_of_another_shape(trainer_factory):
    t = trainer_factory()
    run_steps(t, 1)
    ck = checkpointer(t)
    path = ck.save(t)
    other = trainer_factory()
    wide = Transformer(ModelConfig(size="tiny", vocab_size=256, d_model=128))
    other.model, other.optimizer = wide, torch.optim.AdamW(wide.parameters())
    with pytest.raises(StateError, match="does not fit this model.*embed_tokens.weight"):
        checkpointer(other).load(other, path)
    ck.close()


def test_flipped_byte_names_the_file_and_the_previous_good_one(trainer_factory):
    t = trainer_factory()
    ck = checkpointer(t)
    run_steps(t, 1)
    good = ck.save(t)
    run_steps(t, 1)
    bad = ck.save(t)
    victim = bad / "__0_1.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    fresh = trainer_factory()
    with pytest.raises(StateError) as err:
        checkpointer(fresh).load(fresh, bad)
    assert str(victim) in str(err.value) and str(good) in str(err.value)
    assert fresh.step == 0  # nothing was half-loaded
    ck.close()


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB filesystem (tmpfs; needs root, else the test is skipped)."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_full_disk_keeps_the_earlier_checkpoint(small_disk):
    from .conftest import make_trainer

    t = make_trainer(small_disk / "run", keep_last=1)
    ck = checkpointer(t)
    run_steps(t, 1)
    first = ck.save(t)  # about 1.4 MB: fits once, not twice
    run_steps(t, 1)
    with pytest.raises(StateError, match="disk full.*step_00000001") as err:
        ck.save(t)
    assert "checkpoint.keep_last" not in str(err.value)  # keep_last=1 already: lowering it cannot help
    assert checkpoints(small_disk / "run") == [first] and verify(first) == []
    assert unfinished(small_disk / "run") == []
    fresh = make_trainer(small_disk / "run")
    assert checkpointer(fresh).load(fresh, first)["step"] == 1
    ck.close()


def test_digests_computed_while_writing_match_the_files(tmp_path):
    import torch.distributed.checkpoint as dcp

    from kiln.state.storage import hashing_writer
    from kiln.state.verify import sha256_file

    state = {"w": torch.randn(300, 200), "b": torch.arange(10), "step": 3}
    writer = hashing_writer(tmp_path / "c", threads=3, fsync=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    digests = writer.fs.digests
    assert sorted(digests) == sorted(p.name for p in (tmp_path / "c").glob("*.distcp")) and len(digests) >= 2
    for name, info in digests.items():
        path = tmp_path / "c" / name
        assert info == {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def test_a_file_in_place_of_checkpoints_is_refused_before_training(trainer_factory):
    """A file named checkpoints/ in the run directory: refused when the checkpointer starts, not after the steps up
    to the first save were trained (a NotADirectoryError traceback there)."""
    t = trainer_factory()
    ckdir = Path(t.cfg.train.run_dir) / "checkpoints"
    ckdir.parent.mkdir(parents=True, exist_ok=True)
    ckdir.write_text("notes\n")
    with pytest.raises(StateError, match="checkpoints: a file of that name is in the way"):
        checkpointer(t)
    assert ckdir.read_text() == "notes\n"
