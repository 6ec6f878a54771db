"""Hang detection on a fake clock: the median rule, the stack dump, a slow step that recovers, the exit with
an emergency checkpoint; and once end to end, a run whose loop blocks between steps."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.config import MonitorConfig
from kiln.monitor import hang as hang_mod
from kiln.monitor.hang import EXIT_CODE, HangWatch, rescue_for


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _watch(tmp_path, **cfg):
    clock, said, codes = FakeClock(), [], []
    w = HangWatch(MonitorConfig(**cfg), tmp_path, said.append, clock, codes.append)
    return w, clock, said, codes


def _steps(w: HangWatch, clock: FakeClock, n: int, seconds: float, first: int = 1) -> int:
    for step in range(first, first + n):
        w.step_started(step)
        clock.t += seconds
        w.step_ended(step)
    return first + n


def test_a_step_far_slower_than_the_median_dumps_every_stack(tmp_path):
    w, clock, said, codes = _watch(tmp_path, hang_factor=10, hang_min_s=1, hang_exit_s=0)
    nxt = _steps(w, clock, 4, 2.0)
    w.step_started(nxt)
    clock.t += 100
    w.check()
    assert not said  # four steps are not enough for a median: compilation is not a baseline
    nxt = _steps(w, clock, 2, 2.0, nxt)
    w.step_started(nxt)
    clock.t += 19
    w.check()
    assert not said  # under 10 x the 2 s median
    clock.t += 2
    w.check()
    dump = tmp_path / f"hang-step{nxt}.txt"
    assert dump.is_file() and len(said) == 1 and str(dump) in said[0] and "10 x the median" in said[0]
    text = dump.read_text()
    assert "test_a_step_far_slower_than_the_median_dumps_every_stack" in text  # this thread's own stack
    w.check()
    assert len(said) == 1 and codes == []  # once per hang; hang_exit_s=0 never exits


def test_the_floor_and_a_slow_step_that_recovers(tmp_path):
    w, clock, said, _ = _watch(tmp_path, hang_factor=10, hang_min_s=30, hang_exit_s=0)
    nxt = _steps(w, clock, 5, 0.01)
    w.step_started(nxt)
    clock.t += 29
    w.check()
    assert not said  # 10 x 0.01 s would be 0.1 s: hang_min_s is the floor
    clock.t += 2
    w.check()
    assert len(said) == 1
    w.step_ended(nxt)  # it finished after all
    assert "slow, not hung" in said[1] and w.dumped_at is None and w.durations[-1] == pytest.approx(31)


def test_time_between_steps_has_its_own_limit(tmp_path):
    w, clock, said, _ = _watch(tmp_path, hang_between_s=50, hang_exit_s=0)
    w.step_started(1)
    clock.t += 1
    w.step_ended(1)  # an evaluation or a save runs now
    clock.t += 49
    w.check()
    assert not said
    clock.t += 2
    w.check()
    assert "time after step 1" in said[0] and "monitor.hang_between_s=50" in said[0]


def test_no_progress_after_the_dump_exits_124_with_the_rescue(tmp_path):
    w, clock, said, codes = _watch(tmp_path, hang_factor=0, hang_between_s=10, hang_exit_s=60)
    w.rescue = lambda: "emergency checkpoint of step 3 written to X"
    w.step_started(3)
    w.step_ended(3)
    clock.t += 11
    w.check()
    clock.t += 59
    w.check()
    assert codes == []
    clock.t += 2
    w.check()
    clock.t += 100
    w.check()
    assert codes == [EXIT_CODE]  # once
    assert "emergency checkpoint of step 3 written to X" in said[-1] and f"kiln train {tmp_path}" in said[-1]


class FakeCheckpointer:
    distributed = False

    def __init__(self, tmp_path: Path, during=None):
        self.tmp_path, self.during, self.saved = tmp_path, during, []

    def save(self, trainer, reason, blocking=False):
        path = self.tmp_path / f"step_{trainer.step}"
        path.mkdir()
        self.saved.append(reason)
        if self.during:
            self.during(trainer)
        return path


def test_the_rescue_saves_only_a_consistent_state_that_stayed_still(tmp_path):
    trainer = SimpleNamespace(step=7, consistent=False)
    ckpt = FakeCheckpointer(tmp_path)
    assert "half-updated" in rescue_for(trainer, ckpt, print)() and ckpt.saved == []
    trainer.consistent = True
    assert rescue_for(trainer, ckpt, print)() == f"emergency checkpoint of step 7 written to {tmp_path / 'step_7'}"
    assert ckpt.saved == ["emergency"]
    moving = SimpleNamespace(step=8, consistent=True)
    ckpt2 = FakeCheckpointer(tmp_path, during=lambda t: setattr(t, "step", 9))  # the loop woke up meanwhile
    assert "discarded" in rescue_for(moving, ckpt2, print)()
    assert not (tmp_path / "step_8").exists()


@pytest.mark.slow
def test_a_run_blocked_between_steps_is_dumped_and_stopped_with_a_checkpoint(tmp_path, monkeypatch):
    from kiln.config import load_config
    from kiln.events import Callback
    from kiln.train.run import run

    monkeypatch.setattr(hang_mod, "POLL_S", 0.05)
    released, codes = threading.Event(), []

    def fake_exit(code: int) -> None:  # instead of os._exit: record it and let the loop go on
        codes.append(code)
        released.set()

    original = HangWatch.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "exit_fn": fake_exit})

    monkeypatch.setattr(HangWatch, "__init__", init)
    entered = threading.Event()
    check = HangWatch.check

    def gated(self, now=None):  # the clock runs only once the loop is stuck (a loaded machine is slow to get there)
        if entered.is_set():
            check(self, now)

    monkeypatch.setattr(HangWatch, "check", gated)

    class Stuck(Callback):
        def on_step_end(self, trainer, metrics):
            if trainer.step == 3:
                entered.set()
                assert released.wait(60)  # a sink stuck on the network, say

    cfg = load_config(None, ["model.size=tiny", "data.max_bytes=150000", "data.vocab_size=300", "train.seq_len=32",
                             "train.batch_size=2", "train.max_steps=5", "train.eval_every=0", "train.sample_tokens=0",
                             "checkpoint.every=0", "checkpoint.save_final=false", f"train.run_dir={tmp_path / 'r'}",
                             "monitor.hang_between_s=0.3", "monitor.hang_exit_s=0.3", "train.device=cpu"])
    run(cfg, callbacks=[Stuck()])
    run_dir = tmp_path / "r"
    assert codes == [EXIT_CODE]
    dump = (run_dir / "hang-step3.txt").read_text()
    assert "time after step 3" in dump and "test_hang.py" in dump and "in on_step_end" in dump  # the stuck callback
    meta = json.loads((run_dir / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["reason"] == "emergency" and meta["step"] == 3
