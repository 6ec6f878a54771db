"""Choosing what to resume from: fallback past damaged checkpoints, config and data checks, modes."""

from __future__ import annotations

import os
import signal

import pytest

from kiln.config import RunConfig, derive
from kiln.errors import StateError
from kiln.state.inspect import describe
from kiln.state.preempt import SignalGuard
from kiln.state.resume import check_compatible, config_differences, latest_good, resume_target
from kiln.state.rundir import checkpoints, unfinished
from kiln.state.verify import read_meta

from .conftest import PRINTS, saved_checkpoints


def test_auto_falls_back_past_damaged_checkpoints_and_says_so(trainer_factory):
    t, (p1, p2, p3) = saved_checkpoints(trainer_factory, 3)
    (p3 / "state.json").write_text("{}")  # same step, altered content
    (p2 / "rank0.json").unlink()
    logs = []
    assert latest_good(t.cfg.train.run_dir, logs.append) == p1
    assert "falling back to" in logs[0] and "step_00000003" in logs[0] and "rank0.json: missing" in logs[0]


def test_resume_sets_damaged_newer_checkpoints_aside(trainer_factory):
    t, (p1, p2, p3) = saved_checkpoints(trainer_factory, 3)
    (p3 / "rank0.json").write_text("{}")
    logs = []
    run_dir, chosen = resume_target(t.cfg, "auto", logs.append)
    assert chosen == p2 and checkpoints(run_dir) == [p1, p2]
    assert (p3.parent / f".damaged-{p3.name}" / "meta.json").is_file()  # moved, not deleted
    assert any("moved damaged" in m for m in logs)
    assert "set aside" in describe(run_dir)


def test_every_checkpoint_damaged_is_an_error(trainer_factory):
    t, paths = saved_checkpoints(trainer_factory, 3)
    for p in paths:
        (p / ".metadata").write_bytes(b"x")
    with pytest.raises(StateError, match="every checkpoint .* is damaged"):
        latest_good(t.cfg.train.run_dir, print)


def test_unfinished_save_is_never_resumed_and_is_cleaned(trainer_factory):
    t, (_, p2, p3) = saved_checkpoints(trainer_factory, 3)
    (p3 / "meta.json").unlink()  # as if killed before the rename (a .tmp-* dir)
    p3.rename(p3.with_name(".tmp-" + p3.name))
    logs = []
    run_dir, chosen = resume_target(t.cfg, "auto", logs.append)
    assert chosen == p2 and unfinished(run_dir) == [] and "never completed" in logs[0]


def test_step_dir_without_meta_is_set_aside_not_deleted(trainer_factory):
    t, (_, p2, p3) = saved_checkpoints(trainer_factory, 3)
    (p3 / "meta.json").unlink()  # never done by Kiln: a manual change or a partial copy
    logs = []
    _, chosen = resume_target(t.cfg, "auto", logs.append)
    assert chosen == p2 and (p3.parent / f".damaged-{p3.name}" / "state.json").is_file()
    assert any("no meta.json" in m for m in logs)


def test_config_differences_ignore_what_does_not_change_the_numbers():
    a = RunConfig().model_dump(mode="json")
    b = RunConfig.model_validate({"train": {"lr": 1e-3, "eval_every": 7, "device": "cuda"},
                                  "logging": {"every": 1}, "checkpoint": {"every": 5}}).model_dump(mode="json")
    assert config_differences(a, b) == ["train.lr: 0.002 -> 0.001"]
    assert len(config_differences(a, b, all_keys=True)) == 5
    # where the base lives: a run that recorded it relative resumes with it recorded whole
    rel, whole = ({**a, "model": {**a["model"], "init_from": p}} for p in ("models/base", "/work/models/base"))
    assert config_differences(rel, whole) == []


def test_mismatch_names_what_differs_unless_forced(trainer_factory):
    t, paths = saved_checkpoints(trainer_factory, 3)
    meta = read_meta(paths[-1])
    cfg = derive(t.cfg, {"train.max_steps": 99})
    changed = {**PRINTS, "tokenizer": "t1"}
    with pytest.raises(StateError) as err:
        check_compatible(meta, cfg, changed, force=False, log=print)
    assert "train.max_steps: 50 -> 99" in str(err.value) and "tokenizer: t0 -> t1" in str(err.value)
    assert "--resume force" in str(err.value)
    logs = []
    check_compatible(meta, cfg, changed, force=True, log=logs.append)
    assert "train.max_steps" in logs[0]
    check_compatible(meta, t.cfg, PRINTS, force=False, log=print)  # unchanged: fine


def test_never_starts_fresh_beside_a_run_with_checkpoints(trainer_factory):
    t, paths = saved_checkpoints(trainer_factory, 3)
    cfg = t.cfg.model_copy(deep=True)
    run_dir, chosen = resume_target(cfg, "never", print)
    assert chosen is None and run_dir.name == "run-1" and checkpoints(run_dir) == []
    assert len(checkpoints(paths[0].parent.parent)) == 3  # the old run is untouched


def test_signal_guard_turns_the_first_signal_into_a_request():
    before = signal.getsignal(signal.SIGTERM)
    with SignalGuard(log=print) as guard:
        assert guard.should_stop() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.should_stop() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_batch_size_that_keeps_the_global_batch_on_other_ranks_is_an_elastic_resume(trainer_factory):
    t, paths = saved_checkpoints(trainer_factory, 3)
    meta = {**read_meta(paths[-1]), "world_size": 2}  # as if saved by 2 processes
    b = t.cfg.train.batch_size
    cfg = derive(t.cfg, {"train.batch_size": 2 * b})
    logs = []
    check_compatible(meta, cfg, PRINTS, force=False, log=logs.append, world=1)  # same global batch
    assert "elastic resume: 2 -> 1" in logs[0]
    with pytest.raises(StateError, match=f"train.batch_size: {b} -> {2 * b}"):
        check_compatible(meta, cfg, PRINTS, force=False, log=print, world=2)  # global batch doubled


def test_the_elastic_resume_says_the_global_batch_with_its_accumulation(trainer_factory):
    """2 ranks x 8 x 2 accumulated is 32 sequences a step; the note said 16, beside the run's 'global batch: 32'."""
    t, paths = saved_checkpoints(trainer_factory, 3)
    meta = {**read_meta(paths[-1]), "world_size": 2}
    meta["config"]["train"].update(batch_size=8, grad_accum=2)
    cfg = derive(t.cfg, {"train.batch_size": 16, "train.grad_accum": 2})
    logs = []
    check_compatible(meta, cfg, PRINTS, force=True, log=logs.append, world=1)
    assert "train.batch_size 8 -> 16 keeps the global batch of 32 sequences" in logs[0]


def test_with_a_global_batch_in_tokens_the_micro_batch_may_change_on_other_ranks(trainer_factory):
    """train.global_batch_tokens fixes the global batch: 2 ranks x 1 row x 2 accumulated -> 1 rank x 2 rows x 2
    is elastic (the note said 'keeps the global batch of 2 sequences' beside a global batch of 4)."""
    t, paths = saved_checkpoints(trainer_factory, 3)
    meta = {**read_meta(paths[-1]), "world_size": 2}
    tokens = 4 * t.cfg.train.seq_len
    meta["config"]["train"].update(batch_size=1, global_batch_tokens=tokens)
    cfg = derive(t.cfg, {"train.batch_size": 2, "train.global_batch_tokens": tokens})
    logs = []
    check_compatible(meta, cfg, PRINTS, force=False, log=logs.append, world=1)
    assert logs == ["elastic resume: 2 -> 1 process(es), train.batch_size 1 -> 2 keeps the global batch of 4 "
                    "sequences"]
    with pytest.raises(StateError, match="train.batch_size: 1 -> 2"):  # on 2 ranks: another micro-batch asks
        check_compatible(meta, cfg, PRINTS, force=False, log=print, world=2)

