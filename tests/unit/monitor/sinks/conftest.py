"""A stand-in trainer for driving sinks through their events (the sinks read only these attributes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.config import load_config
from kiln.events import Events


@pytest.fixture
def drive():
    """drive(sink, cfg, steps, start=0): the events of a short run, as the trainer and run.py emit them; with
    status=None the run is left open (trainer.events emits more)."""

    def run(sink, cfg, steps: range, start: int = 0, status: str | None = "finished", sample: str | None = None):
        events = Events([sink], log=print)
        trainer = SimpleNamespace(step=start, cfg=cfg, device=torch.device("cpu"), events=events)
        events.emit("on_eval_end", trainer, {"step": start, "val_loss": 5.0, "val_ppl": 148.4})
        events.emit("on_train_start", trainer)
        for s in steps:
            trainer.step = s
            events.emit("on_step_end", trainer, {"step": s, "loss": 10.0 / s, "lr": 1e-3, "tokens": 128 * s,
                                                 "gpu0.util%": 50.0 + s})
        if status == "finished":
            events.emit("on_eval_end", trainer, {"step": trainer.step, "val_loss": 4.0, "val_ppl": 54.6})
            events.emit("on_train_end", trainer, {})
        if sample is not None:
            events.emit("on_sample", trainer, sample)
        if status is not None:
            events.emit("on_run_end", trainer, status)
        assert not sink.disabled, "the sink failed: see the log above"
        return trainer

    return run


@pytest.fixture
def config():
    def make(*overrides: str):
        return load_config(None, list(overrides))

    return make
