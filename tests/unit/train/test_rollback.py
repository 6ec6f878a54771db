"""Rollback of bad steps on the CPU: a corrupted sample that makes the loss NaN or spike is undone from the
memory snapshot and passed over; the weights come out exactly as those of a run that never saw it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.errors import TrainingError
from kiln.events import Callback
from kiln.monitor.sinks import JsonlSink
from kiln.state.checkpointer import Checkpointer
from kiln.state.preempt import SignalGuard, train_guarded
from kiln.state.snapshot import MemorySnapshots
from kiln.state.verify import read_meta
from kiln.train.rollback import Rollback

from .healing import Notices, Numerics, Samples, config, records, trainer, weights


def run(tmp_path, name, poison=(), scale=None, skip=None, rollback=True, steps=16, log_every=1, checkpoint=None,
        extra=(), **recovery):
    rcfg = {"snapshot_every": 4, "spike_window": 5, "spike_zscore": 6.0, **recovery}
    cfg = config(tmp_path / name, steps=steps, recovery=rcfg, log_every=log_every, checkpoint=checkpoint)
    log = Notices()
    callbacks = [log, JsonlSink(tmp_path / name / "metrics.jsonl"), *extra]
    if rollback:
        callbacks.insert(0, Rollback(cfg.recovery, MemorySnapshots(lambda m: None)))
    t = trainer(cfg, Samples(4, poison), callbacks)
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    Numerics(t.model, scale)
    if skip is not None:
        t.skips.add(*skip)
    return t, log


@pytest.mark.parametrize("scale", [None, 200.0], ids=["nan", "spike"])
def test_a_bad_sample_is_rolled_back_and_the_weights_equal_a_run_without_it(tmp_path, scale):
    t, log = run(tmp_path, "healed", poison=[38], scale=scale)  # sample 38: step 10 (samples 36..39)
    t.train()
    assert t.step == 16  # the run finished
    [(kind, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 10 and info["to_step"] == 8 and info["skipped"] == [36, 40]
    assert ("NaN" in info["reason"] or "nan" in info["reason"]) if scale is None else "spike" in info["reason"]
    assert t.skips.state_dict() == [[36, 40, 10]] and t.state_dict()["skipped"] == [[36, 40, 10]]
    # metrics.jsonl: the rollback is recorded, and each step's training record appears once
    recs = records(tmp_path / "healed" / "metrics.jsonl")
    [rb] = [r for r in recs if r["event"] == "rollback"]
    assert rb["skipped"] == [36, 40] and rb["bad_step"] == 10
    steps = [r["step"] for r in recs if r["event"] == "train"]
    assert steps == list(range(1, 17))
    # a run whose data never held samples 36..39 (and no rollback) ends with the very same weights
    clean, _ = run(tmp_path, "clean", poison=[38], scale=scale, skip=(36, 40, 10), rollback=False)
    clean.train()
    a, b = weights(t), weights(clean)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert t.train_loader.sample == clean.train_loader.sample == 17 * 4  # 16 steps, one batch passed over


def test_without_rollback_a_nan_stops_the_run(tmp_path):
    t, _ = run(tmp_path, "off", poison=[5], rollback=False, steps=4)
    with pytest.raises(TrainingError, match="loss became nan"):
        t.train()


def test_too_many_rollbacks_stop_with_the_good_state_saved_and_the_samples_named(tmp_path):
    cfg_dir = tmp_path / "many"
    t, log = run(tmp_path, "many", poison=[21, 26, 30], max_rollbacks=2, rollback_window=100)
    ck = Checkpointer(cfg_dir, t.cfg, {}, lambda m: None)
    said: list[str] = []
    with pytest.raises(TrainingError) as err:
        train_guarded(t, ck, SignalGuard(said.append), cfg_dir, said.append)
    t.events.end_run(t, err.value)  # as kiln.events.RunEnd does: metrics.jsonl is closed (no unclosed file later)
    msg = str(err.value)
    # step 6 goes bad on samples 20..23, then (those passed over) on 24..27, then on 28..31: the third stops it
    assert "3 bad steps within 100 steps" in msg and "recovery.max_rollbacks=2" in msg
    assert "step 6: samples 20..23; step 6: samples 24..27; step 6: samples 28..31" in msg
    assert "state of step 4" in msg
    meta = ck.load(trainer(t.cfg, Samples(4)), cfg_dir / "checkpoints" / "step_00000004", check_hashes=True)
    assert meta["reason"] == "emergency"
    resumed = trainer(t.cfg, Samples(4))
    Checkpointer(cfg_dir, t.cfg, {}, lambda m: None).load(resumed, cfg_dir / "checkpoints" / "step_00000004")
    # the resumed run trains step 5 on samples 16..19, then passes over all three batches
    assert resumed.skips.state_dict() == [[20, 24, 6], [24, 28, 6], [28, 32, 6]]
    resumed._step_batch()
    assert resumed.step_samples == (16, 20)
    resumed._step_batch()
    assert resumed.step_samples == (32, 36)


def test_too_many_bad_first_steps_say_that_nothing_is_saved(tmp_path):
    """Every first step bad (samples 0..11 poisoned): the run said 'emergency checkpoint of step 0 written to None'
    and that the state of step 0 was saved to resume from, passing over the samples; step 0 is no checkpoint, and a
    start again meets the same samples."""
    t, _ = run(tmp_path, "first", poison=[0, 4, 8], max_rollbacks=2, rollback_window=100)
    ck = Checkpointer(tmp_path / "first", t.cfg, {}, lambda m: None)
    said: list[str] = []
    with pytest.raises(TrainingError) as err:
        train_guarded(t, ck, SignalGuard(said.append), tmp_path / "first", said.append)
    t.events.end_run(t, err.value)
    msg = str(err.value)
    assert "step 1: samples 0..3; step 1: samples 4..7; step 1: samples 8..11" in msg
    assert "saved as an emergency checkpoint" not in msg and "is the start (step 0), which is no checkpoint" in msg
    assert not any("None" in m for m in said) and any("no emergency checkpoint" in m for m in said)
    assert not (tmp_path / "first" / "checkpoints").is_dir() or not list((tmp_path / "first" / "checkpoints").iterdir())


def test_lr_factor_lowers_the_rate_after_a_rollback_and_a_resume_keeps_it(tmp_path):
    t, _ = run(tmp_path, "lr", poison=[14], steps=6, lr_factor=0.5)
    t.train()
    assert t.lr_scale == 0.5
    from kiln.train.optim import lr_factor

    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 3e-3 * lr_factor(6, t.cfg.train))
    other = trainer(t.cfg, Samples(4))
    other.scheduler.last_epoch = t.scheduler.last_epoch
    other.load_state_dict(t.state_dict())
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(t.optimizer.param_groups[0]["lr"])


def test_spike_verdict_needs_a_full_window_and_a_high_z_score(tmp_path):
    cfg = config(tmp_path, recovery={"spike_window": 4, "spike_zscore": 3.0})
    rb = Rollback(cfg.recovery, MemorySnapshots())
    assert rb.verdict(100.0, 1.0) is None  # no window yet
    for i, v in enumerate([3.0, 3.1, 2.9, 3.0]):
        rb.window.append((i, v))
    assert rb.verdict(3.2, 1.0) is None
    assert "spike" in rb.verdict(4.0, 1.0)
    assert "gradient norm is inf" == rb.verdict(3.0, math.inf)
    off = Rollback(config(tmp_path, recovery={"spike_window": 4, "spike_zscore": 0}).recovery, MemorySnapshots())
    off.window.extend(rb.window)
    assert off.verdict(40.0, 1.0) is None


def test_host_room_counts_moments_of_trainable_weights_only_and_refuses_what_does_not_fit(monkeypatch):
    import psutil

    from kiln.train.rollback import host_room

    model = torch.nn.Sequential(torch.nn.Linear(100, 10, bias=False), torch.nn.Linear(10, 10, bias=False))
    model[1].weight.requires_grad_(False)  # frozen (a LoRA base): one copy, no moments
    per = 3 * 1000 * 4 + 100 * 4

    class Mem:
        available = 10 * per

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    assert host_room(model, copies=1, local_world=1) == (True, per, 10 * per)
    assert host_room(model, copies=2, local_world=4) == (False, 8 * per, 10 * per)


# ---------------------------------------------------------------- checks only at check points


class Pending(Callback):
    """Records, after each step, how many steps the rollback has noted but not checked."""

    def __init__(self):
        self.rollback, self.after = None, {}

    def on_train_start(self, trainer):
        self.rollback = next(c for c in trainer.events.callbacks if isinstance(c, Rollback))

    def on_step_end(self, trainer, metrics):
        self.after.setdefault(trainer.step, len(self.rollback.pending))


def test_a_nan_at_a_step_that_does_not_log_is_found_at_the_next_check_and_rolled_back_the_same(tmp_path):
    # logging every 5 steps, snapshots every 8: the check points are steps 5, 8, 10, 15 and 16
    lazy, log = run(tmp_path, "lazy", poison=[9], log_every=5, snapshot_every=8)  # sample 9: step 3 (8..11)
    lazy.train()
    assert lazy.step == 16
    [(_, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 3 and info["to_step"] == 0 and info["skipped"] == [8, 12]
    assert lazy.skips.state_dict() == [[8, 12, 3]]
    recs = records(tmp_path / "lazy" / "metrics.jsonl")
    assert [r["step"] for r in recs if r["event"] == "train"] == [5, 10, 15, 16]
    # the same as checking every step, and as a run whose data never held samples 8..11
    eager, elog = run(tmp_path, "eager", poison=[9], snapshot_every=8)
    eager.train()
    [(_, einfo)] = [n for n in elog.notices if n[0] == "rollback"]
    assert (einfo["bad_step"], einfo["to_step"], einfo["skipped"]) == (3, 0, [8, 12])
    clean, _ = run(tmp_path, "clean", poison=[9], skip=(8, 12, 3), rollback=False, log_every=5)
    clean.train()
    a, b, c = weights(lazy), weights(eager), weights(clean)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    assert lazy.train_loader.sample == clean.train_loader.sample == 17 * 4


def test_no_device_value_is_read_by_kiln_between_check_points(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    import kiln

    src = str(Path(kiln.__file__).parent)
    reads: list[str] = []  # host reads of tensors by kiln's code (torch's own, as Adam's step counter, aside)
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            if sys._getframe(1).f_code.co_filename.startswith(src):
                reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    checked: list[int] = []  # the number of steps each check reads
    real_verify = Rollback.verify

    def verify(self, trainer, *read, **wait):
        if self.pending:
            checked.append(len(self.pending))
        return real_verify(self, trainer, *read, **wait)

    monkeypatch.setattr(Rollback, "verify", verify)

    class Reads(Callback):
        def __init__(self):
            self.at = {}

        def on_step_end(self, trainer, metrics):
            self.at[trainer.step] = len(reads)
            reads.clear()

    pending, counted = Pending(), Reads()
    t, _ = run(tmp_path, "quiet", log_every=5, snapshot_every=8, extra=[pending, counted])
    reads.clear()
    t.train()
    # reads only at the check points: at a logging step (5, 10, 15, 16) the sync the throughput clock needs
    # and one read that the rollback's check shares with the metrics; at step 8 (a snapshot) the check's own and
    # the snapshot's of the losses not yet logged (steps 6-8, in one transfer)
    assert counted.at == {s: {5: 2, 8: 2, 10: 2, 15: 2, 16: 2}.get(s, 0) for s in range(1, 17)}
    assert checked == [5, 3, 2, 5, 1]  # each check reads the steps noted since the last, in one transfer
    assert pending.after == {1: 1, 2: 2, 3: 3, 4: 4, 5: 0, 6: 1, 7: 2, 8: 0, 9: 1, 10: 0, 11: 1, 12: 2, 13: 3,
                             14: 4, 15: 0, 16: 0}


class Trip(Callback):
    """At `step` (the first time only): ask for a stop by signal, or fail as a bug would."""

    def __init__(self, step: int, how: str, guard: SignalGuard | None = None):
        self.step, self.how, self.guard, self.done = step, how, guard, False

    def on_step_end(self, trainer, metrics):
        if trainer.step != self.step or self.done:
            return
        self.done = True
        if self.how == "signal":
            self.guard.requested = "SIGTERM"
        elif self.how == "stop":
            trainer.stop_reason = "asked to stop"
        else:
            raise RuntimeError("a bug in a callback")


@pytest.mark.parametrize("how", ["signal", "error"])
def test_a_checkpoint_asked_for_at_an_unchecked_step_checks_first_and_saves_the_rolled_back_state(tmp_path, how):
    from kiln.state.callback import CheckpointEvery

    # checkpoints and snapshots every 2 steps, logs every 5: step 3 (samples 8..11) goes bad, and at its end a
    # signal (or an error) asks for a checkpoint before any check has read it
    d = tmp_path / how
    said: list[str] = []
    guard = SignalGuard(said.append)
    cfg = config(d, steps=16, checkpoint={"every": 2, "snapshot_every": 2})
    ck = Checkpointer(d, cfg, {}, lambda m: None)
    trip = Trip(3, how, guard)
    t, _ = run(tmp_path, how, poison=[9], log_every=5, checkpoint={"every": 2, "snapshot_every": 2},
               extra=[trip, CheckpointEvery(ck, guard)])
    t.events.callbacks[0] = Rollback(t.cfg.recovery, ck.snapshots, 2)  # the checkpointer's snapshots, as run.py
    if how == "signal":
        assert train_guarded(t, ck, guard, d, said.append) is None
    else:
        with pytest.raises(RuntimeError, match="a bug"):
            train_guarded(t, ck, guard, d, said.append)
    saved = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert saved == ["step_00000002"]  # nothing of step 3: it was bad; step 2's checkpoint now holds the skip
    meta = read_meta(d / "checkpoints" / "step_00000002")
    assert meta["reason"] == ("preempt" if how == "signal" else "emergency")
    resumed = trainer(t.cfg, Samples(4))
    Checkpointer(d, t.cfg, {}, lambda m: None).load(resumed, d / "checkpoints" / "step_00000002")
    assert resumed.step == 2 and resumed.skips.state_dict() == [[8, 12, 3]]
    resumed._step_batch()
    assert resumed.step_samples == (12, 16)  # step 3 passes over the bad samples


def test_a_stop_at_an_unchecked_step_checks_it_first_and_stops_at_the_snapshot_when_it_was_bad(tmp_path):
    t, log = run(tmp_path, "stop", poison=[9], log_every=5, snapshot_every=2, steps=8, extra=[Trip(3, "stop")])
    t.train()
    [(_, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 3 and info["to_step"] == 2
    assert t.step == 2 and t.stop_reason == "asked to stop" and t.skips.state_dict() == [[8, 12, 3]]
    clean, _ = run(tmp_path, "clean", steps=2, rollback=False)
    clean.train()
    a, b = weights(t), weights(clean)  # the state the run ends with is that of its last good step
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_when_the_check_cannot_read_the_device_no_checkpoint_of_unchecked_steps_is_written(tmp_path, monkeypatch):
    from kiln.state.callback import CheckpointEvery
    from kiln.train import rollback

    def broken(values, mesh):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    # a signal after step 3 asks for a checkpoint; the check before it fails, and so does the emergency one's
    d, said = tmp_path / "broken", []
    guard = SignalGuard(said.append)
    ck = Checkpointer(d, config(d, steps=16), {}, lambda m: None)
    t, _ = run(tmp_path, "broken", log_every=5, snapshot_every=8, extra=[Trip(3, "signal", guard),
                                                                         CheckpointEvery(ck, guard)])
    monkeypatch.setattr(rollback, "host_read", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        train_guarded(t, ck, guard, d, said.append)
    assert t.step == 3 and len(t.events.callbacks[0].pending) == 3  # still unchecked
    assert any("no emergency checkpoint: the steps since the last check" in m for m in said)
    assert not (d / "checkpoints").exists() or not any((d / "checkpoints").iterdir())


def test_a_spike_after_a_resume_is_rolled_back_as_in_an_uninterrupted_run(tmp_path):
    """The spike window is saved with the run's counters (under the key "rollback"): a resumed run judges its first
    steps against the steps before the checkpoint, not against an empty window that needs spike_window steps."""
    d = tmp_path / "resumed"
    first, _ = run(tmp_path, "resumed", steps=8, scale=200.0)
    first.train()
    ck = Checkpointer(d, first.cfg, {}, lambda m: None)
    path = ck.save(first, blocking=True)
    saved = json.loads((path / "state.json").read_text())["trainer"]
    assert [s for s, _ in saved["rollback"]["window"]] == [4, 5, 6, 7, 8]  # the last spike_window good steps
    # the resumed run: sample 38 (step 10: samples 36..39) makes its loss spike
    again, log = run(tmp_path, "resumed", steps=16, poison=[38], scale=200.0)
    Checkpointer(d, again.cfg, {}, lambda m: None).load(again, path)
    assert list(again.events.callbacks[0].window) == list(first.events.callbacks[0].window)
    again.train()
    [(_, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 10 and info["to_step"] == 8 and "spike" in info["reason"]
    assert again.step == 16 and again.skips.state_dict() == [[36, 40, 10]]


def test_a_rollback_goes_to_a_newer_checkpoint_on_disk_than_the_snapshot(tmp_path):
    """Snapshots every 8 steps, checkpoints every 4: step 7 goes bad and the run goes back to step 4's checkpoint
    (not to the snapshot of step 0), with the weights of a run that never held step 7's samples."""
    from kiln.state.callback import CheckpointEvery

    d = tmp_path / "disk"
    t, log = run(tmp_path, "disk", poison=[26], steps=10, snapshot_every=8, checkpoint={"every": 4})
    ck = Checkpointer(d, t.cfg, {}, lambda m: None)
    t.events.callbacks[0] = Rollback(t.cfg.recovery, ck.snapshots, checkpointer=ck)
    t.events.callbacks.append(CheckpointEvery(ck))
    t.train()
    [(_, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 7 and info["to_step"] == 4 and info["skipped"] == [24, 28]
    assert ck.snapshots.snapshot.step == 8  # snapshotted from the checkpoint, then again at step 8
    clean, _ = run(tmp_path, "clean", poison=[26], steps=10, skip=(24, 28, 7), rollback=False)
    clean.train()
    a, b = weights(t), weights(clean)
    assert all(torch.equal(a[k], b[k]) for k in a)
