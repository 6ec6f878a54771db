"""kiln.parallel.offload under signals: SIGTERM or Ctrl-C (SIGINT) at any moment of an offloaded run (its AdamW in
the offload's thread mid-step, the forward pass waiting there for its weights, the backward pass, a checkpoint being
written) stops it with a checkpoint whose counters match its weights and moments, and the resumed run ends with the
weights and moments of a run never stopped, bit for bit. CPU, the tiny model (kiln.parallel.offload: the same
thread, schedules and sliced step as a GPU's)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.events import Callback
from kiln.parallel import offload
from kiln.train.run import run

from .test_offload import args, corpus, quiet  # noqa: F401 - corpus is a fixture

STEPS, EVERY = 6, 2  # a checkpoint every EVERY steps; signals come in step AT
AT = 3


def offloaded(root: Path, name: str, *extra: str) -> list[str]:
    """The offloaded run, its master weights stepped in several chunks (each layer's forward waiting for its own)."""
    return args(root, name, "train.offload=optimizer", f"train.max_steps={STEPS}", f"checkpoint.every={EVERY}",
                "checkpoint.save_final=false", "train.grad_clip=1.0", "train.precision=bf16",
                "checkpoint.async_save=false", "recovery.rollback=false", *extra)


class State(Callback):
    """The training state an offloaded run starts with (a resume: what its checkpoint held) and ends with."""

    def __init__(self):
        self.start: dict | None = None
        self.end: dict | None = None

    @staticmethod
    def read(trainer) -> dict:
        o = trainer.offload
        o.wait()
        opt = o.optimizer.state
        return {"step": trainer.step, "sched": trainer.scheduler.last_epoch,
                "masters": [m.detach().clone() for m in o.masters],
                "device": [p.detach().clone() for p in o.params],
                "moments": [{k: v.clone() for k, v in opt[m].items()} if opt.get(m) else {} for m in o.masters]}

    def on_train_start(self, trainer):
        self.start = self.read(trainer)

    def on_train_end(self, trainer, metrics):
        self.end = self.read(trainer)


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two states read by `State.read`."""
    out = [k for k in ("step", "sched") if a[k] != b[k]]
    out += [f"{k} {i}" for k in ("masters", "device") for i, (x, y) in enumerate(zip(a[k], b[k]))
            if not torch.equal(x, y)]
    return out + [f"moments {i}" for i, (x, y) in enumerate(zip(a["moments"], b["moments"]))
                  if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(offload, "CHUNK", 1 << 12)  # the tiny model's masters in several chunks, not one


@pytest.fixture(scope="module")
def reference(corpus):  # noqa: F811
    """Each step's state of the run never stopped."""
    seen: dict[int, dict] = {}

    class Each(State):
        def on_step_end(self, trainer, metrics):
            seen[trainer.step] = self.read(trainer)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offload, "CHUNK", 1 << 12)
        end = Each()
        run(load_config(None, offloaded(corpus, "whole")), console=quiet(), callbacks=[end])
    seen["end"] = end.end
    return seen


@pytest.fixture
def caught():
    """Signals that reach no run's handler are noted here rather than end the test process."""
    got: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    yield got
    for s, h in before.items():
        signal.signal(s, h)


@pytest.fixture
def waiting(monkeypatch) -> threading.Event:
    """Set while the training thread waits in `ready` for weights the offload's thread has not stepped yet."""
    inner, event = offload.OptimizerOffload.ready, threading.Event()

    def ready(self, params):
        event.set()
        try:
            return inner(self, params)
        finally:
            event.clear()

    monkeypatch.setattr(offload.OptimizerOffload, "ready", ready)
    return event


def stop_and_resume(root: Path, name: str, reference: dict, stopped_at: int) -> None:
    """After the stopped run: its checkpoint is the preemption's, of step `stopped_at`, holding that step's state;
    the resumed run ends as the run never stopped."""
    run_dir = root / name
    meta = json.loads((run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "meta.json").read_text())
    assert (meta["reason"], meta["step"]) == ("preempt", stopped_at)
    again = State()
    run(load_config(None, offloaded(root, name)), console=quiet(), callbacks=[again])
    assert differences(again.start, reference[stopped_at]) == []  # the checkpoint: counters, weights, moments
    assert differences(again.end, reference["end"]) == []


def test_sigterm_while_adamw_runs_in_its_thread(corpus, reference, caught, waiting, monkeypatch):  # noqa: F811
    """Sent from inside step AT's AdamW, in the offload's thread, half way through its chunks, while the next step's
    forward pass waits for those weights: the run finishes that step (AT + 1) and saves it."""
    inner, where = offload.HostAdamW.step_only, []

    def step_only(self, indices, *a, **k):
        o = self._offload
        if o.steps == AT and indices[0] >= len(o.masters) // 2 and not where:
            assert waiting.wait(5)  # step AT has ended (its stop check passed): step AT + 1 waits for these weights
            where.append(threading.current_thread().name)
            os.kill(os.getpid(), signal.SIGTERM)
        return inner(self, indices, *a, **k)

    monkeypatch.setattr(offload.HostAdamW, "step_only", step_only)
    run(load_config(None, offloaded(corpus, "adamw")), console=quiet())
    assert where == ["kiln-offload-adamw"] and not caught
    stop_and_resume(corpus, "adamw", reference, AT + 1)


def test_ctrl_c_while_the_forward_pass_waits_for_weights(corpus, reference, caught, waiting, monkeypatch):  # noqa: F811
    """SIGINT delivered to the training thread itself, inside its wait in `ready` for a chunk that step AT's AdamW
    has not stepped yet (the handler runs in the wait, which then goes on)."""
    inner, where, main = offload.HostAdamW.step_only, [], threading.main_thread().ident

    def step_only(self, indices, *a, **k):
        o = self._offload
        if o.steps == AT and indices[0] >= len(o.masters) // 2 and not where:
            assert waiting.wait(5)
            where.append(threading.current_thread().name)
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.02)  # the handler runs while the training thread waits
        return inner(self, indices, *a, **k)

    monkeypatch.setattr(offload.HostAdamW, "step_only", step_only)
    run(load_config(None, offloaded(corpus, "ready")), console=quiet())
    assert where == ["kiln-offload-adamw"] and not caught
    stop_and_resume(corpus, "ready", reference, AT + 1)


def test_sigterm_during_the_backward_pass(corpus, reference, caught, monkeypatch):  # noqa: F811
    inner, sent = offload.OptimizerOffload.finish_gradient, []

    def finish_gradient(self, p, *a, **k):
        if self.steps == AT and self.index[id(p)] == len(self.params) // 2 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return inner(self, p, *a, **k)

    monkeypatch.setattr(offload.OptimizerOffload, "finish_gradient", finish_gradient)
    run(load_config(None, offloaded(corpus, "backward")), console=quiet())
    assert sent and not caught
    stop_and_resume(corpus, "backward", reference, AT + 1)


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "async"])
def test_ctrl_c_while_a_checkpoint_is_written(corpus, reference, caught, monkeypatch, background):  # noqa: F811
    """During the write of step EVERY's checkpoint: in the training thread (checkpoint.async_save=false, the
    preset's), or in the checkpointer's beside the next steps and their AdamW."""
    import kiln.state.checkpointer as c

    inner, sent = c.hash_tree, []

    def hash_tree(root, *a, **k):
        if root.name.endswith(f"step_{EVERY:08d}") and not sent:
            sent.append(threading.current_thread() is threading.main_thread())
            os.kill(os.getpid(), signal.SIGINT)
        return inner(root, *a, **k)

    monkeypatch.setattr(c, "hash_tree", hash_tree)
    name = f"save-{background}"
    run(load_config(None, offloaded(corpus, name, f"checkpoint.async_save={str(background).lower()}")),
        console=quiet())
    assert sent == [not background] and not caught
    stopped = max(int(p.name[5:]) for p in (corpus / name / "checkpoints").glob("step_*"))
    assert EVERY < stopped < STEPS
    stop_and_resume(corpus, name, reference, stopped)
