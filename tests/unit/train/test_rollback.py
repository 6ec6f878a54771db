"""Rollback of bad steps on the CPU: a corrupted sample that makes the loss NaN or spike is undone from the
memory snapshot and passed over; the weights come out exactly as those of a run that never saw it."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import TrainingError
from kiln.monitor.sinks import JsonlSink
from kiln.state.checkpointer import Checkpointer
from kiln.state.preempt import SignalGuard, train_guarded
from kiln.state.snapshot import MemorySnapshots
from kiln.train.rollback import Rollback

from .healing import BAD_TOKEN, Notices, Samples, config, records, trainer, weights


class Numerics:
    """Forward hooks: the rows of a corrupted record blow up, to NaN in the embedding (`scale` None) or to
    `scale` times the final hidden state, whose logits then give a loss spike, as an overflow on bad data does."""

    def __init__(self, t, scale: float | None = None):
        self.scale, self.bad = scale, None
        t.model.embed_tokens.register_forward_hook(self.embedded)
        t.model.norm.register_forward_hook(self.normed)

    def embedded(self, module, args, out):
        self.bad = (args[0] == BAD_TOKEN).all(dim=1)[:, None, None]  # (B, 1, 1)
        if self.scale is not None or not self.bad.any():
            return out
        return torch.where(self.bad, torch.full_like(out[:1], math.nan), out)

    def normed(self, module, args, out):
        if self.scale is None or not self.bad.any():
            return out
        return torch.where(self.bad, out * self.scale, out)


def run(tmp_path, name, poison=(), scale=None, skip=None, rollback=True, steps=16, **recovery):
    rcfg = {"snapshot_every": 4, "spike_window": 5, "spike_zscore": 6.0, **recovery}
    cfg = config(tmp_path / name, steps=steps, recovery=rcfg)
    log = Notices()
    callbacks = [log, JsonlSink(tmp_path / name / "metrics.jsonl")]
    if rollback:
        callbacks.insert(0, Rollback(cfg.recovery, MemorySnapshots(lambda m: None)))
    t = trainer(cfg, Samples(4, poison), callbacks)
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    Numerics(t, scale)
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
