"""Early stopping counts evaluations without an improvement larger than min_delta, stops after patience
of them, writes why to metrics.jsonl, and carries its count across a resume (its state_dict)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kiln.train.early_stop import EarlyStop


def fake_trainer(max_steps: int = 100):
    return SimpleNamespace(step=0, stop_reason=None, cfg=SimpleNamespace(train=SimpleNamespace(max_steps=max_steps)))


def feed(cb, trainer, losses, every=10):
    for loss in losses:
        trainer.step += every
        cb.on_eval_end(trainer, {"step": trainer.step, "val_loss": loss})
        if trainer.stop_reason:
            return trainer.step
    return None


def test_stops_after_patience_evaluations_without_enough_improvement(tmp_path):
    logs, path = [], tmp_path / "metrics.jsonl"
    cb, t = EarlyStop(patience=2, min_delta=0.05, log=logs.append, metrics_path=path), fake_trainer()
    # 3.0 best; 2.97 is not better by more than 0.05; 2.5 is; then two that are not
    assert feed(cb, t, [3.0, 2.97, 2.5, 2.49, 2.6, 1.0]) == 50
    assert "best 2.5000 at step 30" in t.stop_reason and "patience=2" in t.stop_reason
    assert logs and "stopping early at step 50" in logs[0]
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["event"] == "early_stop" and record["step"] == 50 and record["best_step"] == 30


def test_an_evaluation_of_the_same_step_again_is_not_counted_twice():
    cb, t = EarlyStop(patience=2, log=None), fake_trainer()
    feed(cb, t, [2.0, 2.1])
    cb.on_eval_end(t, {"step": t.step, "val_loss": 2.2})  # a resume evaluating its checkpoint's step again
    assert t.stop_reason is None and cb.since == 1


def test_no_stop_at_the_last_step():
    cb, t = EarlyStop(patience=1, log=None), fake_trainer(max_steps=20)
    assert feed(cb, t, [2.0, 2.5]) is None  # the run ends at step 20 anyway


def test_state_survives_a_resume_and_a_stopped_run_stops_again_at_once():
    cb, t = EarlyStop(patience=2, log=None), fake_trainer()
    feed(cb, t, [2.0, 2.1])
    resumed, t2 = EarlyStop(patience=2, log=None), fake_trainer()
    resumed.load_state_dict(json.loads(json.dumps(cb.state_dict())))  # as a checkpoint's state.json holds it
    t2.step = t.step
    assert feed(resumed, t2, [2.05]) == 30  # the count went on: the second evaluation without improvement
    again, t3 = EarlyStop(patience=2, log=None), fake_trainer()
    again.load_state_dict(resumed.state_dict())
    t3.step = 30
    again.on_train_start(t3)
    assert t3.stop_reason and "best 2.0000 at step 10" in t3.stop_reason
    more = EarlyStop(patience=5, log=None)  # resumed with more patience: trains on
    more.load_state_dict(resumed.state_dict())
    t4 = fake_trainer()
    more.on_train_start(t4)
    assert t4.stop_reason is None
