"""Early stopping counts evaluations without an improvement larger than min_delta, stops after patience
of them, tells every sink why (a notice), and carries its count across a resume (its state_dict)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kiln.config import load_config
from kiln.train.early_stop import EarlyStop


def fake_trainer(max_steps: int = 100):
    t = SimpleNamespace(step=0, stop_reason=None, cfg=SimpleNamespace(train=SimpleNamespace(max_steps=max_steps)),
                        notices=[])
    t.notice = lambda kind, **info: t.notices.append((kind, info))
    return t


def feed(cb, trainer, losses, every=10):
    for loss in losses:
        trainer.step += every
        cb.on_eval_end(trainer, {"step": trainer.step, "val_loss": loss})
        if trainer.stop_reason:
            return trainer.step
    return None


def test_stops_after_patience_evaluations_without_enough_improvement():
    logs = []
    cb, t = EarlyStop(patience=2, min_delta=0.05, log=logs.append), fake_trainer()
    # 3.0 best; 2.97 is not better by more than 0.05; 2.5 is; then two that are not, the first of them the lowest:
    # the best named is the run's lowest validation loss, as `kiln runs` shows it beside the reason
    assert feed(cb, t, [3.0, 2.97, 2.5, 2.49, 2.6, 1.0]) == 50
    assert "best 2.4900 at step 40" in t.stop_reason and "patience=2" in t.stop_reason
    assert logs and "stopping early at step 50" in logs[0]
    [(kind, info)] = t.notices  # to every sink: metrics.jsonl, TensorBoard, W&B, MLflow, Prometheus
    assert kind == "early_stop" and info["step"] == 50 and info["best_step"] == 40 and info["best_val_loss"] == 2.49


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


def test_after_a_stop_the_model_takes_the_best_evaluations_weights(tmp_path):
    import torch

    from kiln.state.checkpointer import Checkpointer

    t = fake_trainer()
    t.model = torch.nn.Linear(3, 2)
    cb = EarlyStop(patience=2, log=None, restore_best=True)
    weights = {}
    for loss in (3.0, 2.0, 2.5, 2.6):  # best at step 20; the stop at step 40
        t.step += 10
        with torch.no_grad():
            t.model.weight.add_(1.0)
        weights[t.step] = t.model.weight.detach().clone()
        cb.on_eval_end(t, {"step": t.step, "val_loss": loss})
    assert t.stop_reason and t.step == 40
    assert cb.restore(t, Checkpointer(tmp_path, load_config(None, []), {})) == 20
    assert torch.equal(t.model.weight, weights[20])
    off = EarlyStop(patience=2, log=None, restore_best=False)
    off.load_state_dict(cb.state_dict())
    assert off.restore(t, None) is None  # restore_best off: the last weights stay


def test_a_resumed_stop_reads_the_best_weights_from_its_checkpoint_or_says_it_cannot(tmp_path):
    import torch

    from kiln.state.checkpointer import Checkpointer

    from .healing import Samples, config, trainer, weights

    cfg = config(tmp_path, steps=100)
    t = trainer(cfg, Samples(4))
    ck = Checkpointer(tmp_path, cfg, {}, lambda m: None)
    t.step = 20
    ck.save(t, blocking=True)  # the checkpoint of the best step, as checkpoint.keep_best keeps it
    best = weights(t)
    resumed = EarlyStop(patience=1, log=None, restore_best=True)
    resumed.load_state_dict({"best": 2.0, "best_step": 20, "since": 1, "last_step": 30})  # no copy in memory
    with torch.no_grad():
        t.model.embed_tokens.weight.add_(1.0)
    t.step = 30
    resumed.on_train_start(t)  # it stops again at once
    assert resumed.restore(t, ck) == 20
    assert all(torch.equal(best[k], v) for k, v in weights(t).items())
    resumed.best_step = 10  # a best step without a checkpoint: nothing to read
    assert resumed.restore(t, ck) is None


def test_a_benchmark_score_can_be_watched_higher_being_better():
    cb, t = EarlyStop(patience=2, min_delta=0.01, log=None, metric="tiny_mc/acc", mode="max"), fake_trainer()
    for acc in (0.30, 0.40, None, 0.405, 0.38):  # None: an evaluation the tasks did not run at
        t.step += 10
        cb.on_eval_end(t, {"step": t.step, "val_loss": 1.0, **({"tiny_mc/acc": acc} if acc is not None else {})})
    assert t.stop_reason is not None and "tiny_mc/acc has not improved" in t.stop_reason
    assert cb.best == 0.405 and cb.best_step == 40
    [(kind, info)] = t.notices
    assert info["metric"] == "tiny_mc/acc" and info["best_value"] == 0.405 and "best_val_loss" not in info


def test_a_metric_the_evaluations_do_not_have_is_a_config_error():
    import pytest

    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="no metric of the run's evaluations"):
        load_config(None, ["train.early_stop.patience=2", "train.early_stop.metric=hellaswag/acc"])
    cfg = load_config(None, ["train.early_stop.patience=2", "train.early_stop.metric=hellaswag/acc",
                             "train.early_stop.mode=max", "eval.tasks=[hellaswag]"])
    assert cfg.train.early_stop.metric == "hellaswag/acc"
