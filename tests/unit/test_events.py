"""Events: a failing sink is logged and disabled while training goes on; RunEnd tells sinks how the run ended."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.events import Callback, Events, RunEnd, Sink


class Recorder(Sink):
    def __init__(self, fail_in: str | None = None):
        self.calls, self.fail_in = [], fail_in

    def _record(self, name, *args):
        self.calls.append((name, *args))
        if name == self.fail_in:
            raise OSError(28, "No space left on device")

    def on_step_end(self, trainer, metrics):
        self._record("on_step_end", trainer.step)

    def on_run_end(self, trainer, status):
        self._record("on_run_end", status)


def test_a_failing_sink_is_logged_disabled_and_closed_while_the_others_go_on():
    logged = []
    broken, healthy = Recorder(fail_in="on_step_end"), Recorder()
    events = Events([broken, healthy], log=logged.append)
    trainer = SimpleNamespace(step=1)
    events.emit("on_step_end", trainer, {"loss": 1.0})
    trainer.step = 2
    events.emit("on_step_end", trainer, {"loss": 0.5})
    assert broken.calls == [("on_step_end", 1), ("on_run_end", "failed")]  # closed once, then left alone
    assert healthy.calls == [("on_step_end", 1), ("on_step_end", 2)]
    assert len(logged) == 1 and "sink failed in on_step_end" in logged[0] and "No space left" in logged[0]
    assert "training goes on" in logged[0]


def test_an_error_in_a_callback_that_is_not_a_sink_propagates():
    class Checkpoint(Callback):
        def on_step_end(self, trainer, metrics):
            raise RuntimeError("checkpoint failed")

    with pytest.raises(RuntimeError, match="checkpoint failed"):
        Events([Checkpoint()], log=print).emit("on_step_end", SimpleNamespace(step=1), None)


@pytest.mark.parametrize("ending, train_ended, status", [
    (None, True, "finished"),  # the loop ran to its end, then the model save and the sample
    (None, False, "stopped"),  # preempted: the run returned after its checkpoint without on_train_end
    (KeyboardInterrupt(), True, "stopped"),  # a second signal during the final save
    (RuntimeError("bug"), False, "failed"),
])
def test_run_end_closes_the_sinks_with_how_the_run_ended(ending, train_ended, status):
    sink = Recorder()
    trainer = SimpleNamespace(step=3, events=Events([sink], log=print))
    try:
        with RunEnd() as end:
            end.trainer = trainer
            if train_ended:
                trainer.events.emit("on_train_end", trainer, {})
            if ending is not None:
                raise ending
    except BaseException as e:  # the ending given, which RunEnd lets through
        assert e is ending
    assert sink.calls == [("on_run_end", status)]


def test_run_end_before_a_trainer_exists_emits_nothing():
    with pytest.raises(ValueError), RunEnd():
        raise ValueError("bad data")  # failed before the trainer was made: no sink was opened
