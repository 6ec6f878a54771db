"""meta.json is itself verified (meta.sha256): an edited file list cannot vouch for an altered file."""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln.errors import StateError
from kiln.state.checkpointer import Checkpointer
from kiln.state.resume import latest_good
from kiln.state.verify import verify

from .conftest import PRINTS, saved_checkpoints


def flip_and_cover(ckpt, name="__0_0.distcp"):
    """Flip a byte of `name` and write its new size and sha256 into meta.json, as a careful editor would."""
    victim = ckpt / name
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=1))


def test_edited_meta_entry_and_altered_file_are_refused(trainer_factory):
    t, (good, bad) = saved_checkpoints(trainer_factory, 2)
    flip_and_cover(bad)
    problems = verify(bad)
    assert len(problems) == 1 and "meta.json: sha256 differs from meta.sha256" in problems[0]
    logs = []
    assert latest_good(t.cfg.train.run_dir, logs.append) == good  # resume falls back past it
    assert "step_00000002" in logs[0]
    fresh = trainer_factory()
    with pytest.raises(StateError, match="meta.sha256") as err:
        Checkpointer(t.cfg.train.run_dir, fresh.cfg, PRINTS, print).load(fresh, bad)
    assert str(good) in str(err.value) and fresh.step == 0


def test_a_missing_digest_is_damage_but_format_1_checkpoints_are_still_read(trainer_factory):
    t, (first, second) = saved_checkpoints(trainer_factory, 2)
    (second / "meta.sha256").unlink()
    assert "meta.sha256: missing" in verify(second)[0]
    # a checkpoint written before meta.sha256 existed (format 1): its file list is trusted as written
    (first / "meta.sha256").unlink()
    meta = json.loads((first / "meta.json").read_text())
    (first / "meta.json").write_text(json.dumps({**meta, "format": "kiln-checkpoint/1"}, indent=1))
    assert verify(first) == []
    fresh = trainer_factory()
    assert Checkpointer(t.cfg.train.run_dir, fresh.cfg, PRINTS, print).load(fresh, first)["step"] == 1
