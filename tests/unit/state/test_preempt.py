"""The training loop's signal guard: a process forked while it is active does not inherit its behaviour."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import pytest

from kiln.state.preempt import SignalGuard


def _child(ready) -> None:
    ready.set()
    time.sleep(60)  # killed by the test's SIGTERM long before this ends


def test_a_process_forked_under_the_guard_dies_of_sigterm():
    ctx = mp.get_context("fork")
    with SignalGuard(log=lambda _: None) as guard:
        ready = ctx.Event()
        child = ctx.Process(target=_child, args=(ready,))
        child.start()
        assert ready.wait(30)
        child.terminate()  # SIGTERM
        child.join(30)
        assert child.exitcode == -signal.SIGTERM  # not swallowed as a stop request of the child's own
        assert guard.requested is None  # and the parent's guard saw nothing


@pytest.mark.parametrize("seconds_per_step, checks", [(0.01, [10, 20, 30, 40]), (0.5, [10, 20, 22, 24, 26, 28, 30,
                                                                                         32, 34, 36, 38, 40]),
                                                      (3.0, [10, 20, *range(21, 41)])])
def test_processes_check_for_a_signal_about_once_a_second_and_at_most_every_tenth_step(
        monkeypatch, seconds_per_step, checks):
    """Slow steps (a large model) are checked more often, so a stop comes well within a preemption's grace."""
    import kiln.state.preempt as preempt

    clock = {"now": 100.0}
    asked: list[int] = []
    monkeypatch.setattr(preempt.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(preempt.dist, "all_reduce", lambda tensor, op=None, group=None: asked.append(step))
    guard = preempt.SignalGuard(group=object())  # one process: its own values are the maximum
    for step in range(1, 41):
        clock["now"] += seconds_per_step
        assert guard.should_stop(step) is None
    assert asked == checks


def rank_of_several(monkeypatch, rank: int) -> tuple[dict, list[int]]:
    """SignalGuard as in process `rank` of a run of several: a clock to move (clock["now"]) and the signals it
    would abort with, recorded instead of sent."""
    import kiln.state.preempt as preempt

    clock = {"now": 100.0}
    aborted: list[int] = []
    monkeypatch.setattr(preempt.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(preempt.os, "kill", lambda pid, signum: aborted.append(signum))
    monkeypatch.setattr(preempt.dist, "get_rank", lambda group=None: rank)
    return clock, aborted


def test_with_several_processes_the_same_signal_twice_at_once_is_one_stop_request(monkeypatch, capsys):
    """Slurm signals every process of the job and torchrun passes the signal on: each worker got SIGTERM twice
    within milliseconds and took the second as 'abort now, without the checkpoint'. Only rank 0 says it."""
    import kiln.state.preempt as preempt

    clock, aborted = rank_of_several(monkeypatch, 1)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with preempt.SignalGuard(group=object()) as guard:  # a run of several processes; this one is rank 1
            guard.on_signal(signal.SIGTERM, "SIGTERM")
            clock["now"] += 0.01
            guard.on_signal(signal.SIGTERM, "SIGTERM")  # the copy
            assert guard.requested == "SIGTERM" and aborted == []
            clock["now"] += preempt.SignalGuard.DUPLICATE_S
            guard.on_signal(signal.SIGTERM, "SIGTERM")  # a second request, later: abort
            assert aborted == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert "finishing this step" not in err and "second SIGTERM: aborting" in err  # rank 0 says the first


def test_torchruns_sigterm_after_another_rank_died_is_no_preemption(monkeypatch, tmp_path, capsys):
    """After kill -9 of rank 1, torchrun sent rank 0 SIGTERM and it said 'SIGTERM received: ... writing a
    checkpoint', which never came (a checkpoint needs every rank)."""
    import kiln.state.preempt as preempt
    from kiln.parallel.peers import FAILED_NOTE, note_failure

    rank_of_several(monkeypatch, 0)
    monkeypatch.setenv(FAILED_NOTE, str(tmp_path / "failed"))
    note_failure("rank 1 (pid 7) was killed by SIGKILL", 1)  # as kiln's torchrun does before it stops the others
    before = signal.getsignal(signal.SIGTERM)
    try:
        with preempt.SignalGuard(group=object()) as guard, pytest.raises(SystemExit):
            guard.on_signal(signal.SIGTERM, "SIGTERM")
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert "writing a checkpoint" not in err
    assert "rank 0: stopping, because rank 1 (pid 7) was killed by SIGKILL; no checkpoint" in err


def test_one_process_still_aborts_on_a_second_signal_at_once(monkeypatch):
    import kiln.state.preempt as preempt

    aborted: list[int] = []
    monkeypatch.setattr(preempt.os, "kill", lambda pid, signum: aborted.append(signum))
    before = signal.getsignal(signal.SIGINT)
    try:
        with preempt.SignalGuard(log=lambda _: None) as guard:
            guard.on_signal(signal.SIGINT, "SIGINT")
            guard.on_signal(signal.SIGINT, "SIGINT")  # Ctrl-C twice
            assert aborted == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


def test_sighup_is_a_stop_request_unless_ignored_as_under_nohup(monkeypatch):
    """torchrun passes on the SIGHUP of a closed terminal: the workers died of it without a checkpoint. Where
    SIGHUP is ignored (nohup), it stays ignored."""
    before = signal.getsignal(signal.SIGHUP)
    try:
        with SignalGuard(log=lambda _: None) as guard:
            signal.raise_signal(signal.SIGHUP)
            assert guard.requested == "SIGHUP"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with SignalGuard(log=lambda _: None) as guard:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
            assert guard.requested is None
    finally:
        signal.signal(signal.SIGHUP, before)


def test_with_several_processes_another_signal_at_once_is_the_same_stop_request(monkeypatch):
    """A closed terminal: torchrun passes its SIGHUP on, then the SIGTERM of its launcher's death: one event."""
    import kiln.state.preempt as preempt

    clock, aborted = rank_of_several(monkeypatch, 0)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with preempt.SignalGuard(group=object()) as guard:
            guard.on_signal(signal.SIGHUP, "SIGHUP")
            clock["now"] += 0.01
            guard.on_signal(signal.SIGTERM, "SIGTERM")
            assert guard.requested == "SIGHUP" and aborted == []
    finally:
        signal.signal(signal.SIGTERM, before)


def several_processes(monkeypatch, clock: dict) -> None:
    import kiln.state.preempt as preempt

    monkeypatch.setattr(preempt.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(preempt.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(preempt.dist, "get_world_size", lambda group=None: 2)


def test_a_signal_twice_at_once_does_not_abort_the_final_model_save_of_several_processes(monkeypatch):
    """A scheduler's SIGTERM to every process, passed on again by torchrun: rank 0 took the copy as a second
    signal and aborted the final model save ('second SIGTERM during the final model save')."""
    from kiln.state.preempt import Interrupted, StopSignals

    clock = {"now": 100.0}
    several_processes(monkeypatch, clock)
    with StopSignals("during the final model save", "model/ is incomplete", defer=True) as saving:
        saving.on_signal(signal.SIGTERM, "SIGTERM")
        clock["now"] += 0.01
        saving.on_signal(signal.SIGTERM, "SIGTERM")  # the copy
        assert saving.received == "SIGTERM"
        clock["now"] += SignalGuard.DUPLICATE_S
        with pytest.raises(Interrupted, match="second SIGTERM"):  # a second request, later
            saving.on_signal(signal.SIGTERM, "SIGTERM")


def test_the_copy_of_a_signal_that_stopped_the_start_up_does_not_kill_the_process_as_it_unwinds(monkeypatch):
    """At start-up the first SIGTERM raises at once and the block is left: its copy from torchrun, a moment
    later, met the default handler and killed the process silently (no message, exit -15)."""
    from kiln.state.preempt import Interrupted, StopSignals

    clock = {"now": 100.0}
    several_processes(monkeypatch, clock)
    later: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: later.append(signum))
    try:
        with pytest.raises(Interrupted, match="SIGTERM during start-up"), StopSignals("during start-up", "stopped"):
            signal.raise_signal(signal.SIGTERM)
        clock["now"] += 0.01
        signal.raise_signal(signal.SIGTERM)  # the copy: ignored
        assert later == []
        clock["now"] += SignalGuard.DUPLICATE_S
        signal.raise_signal(signal.SIGTERM)  # a later one: handled as before the block
        assert later == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_resume_command_of_a_job_of_several_processes_starts_as_many(monkeypatch, tmp_path):
    """`kiln train RUN_DIR` alone resumed a 2-process job on one process, which refused its per-rank batch."""
    import kiln.state.preempt as preempt

    assert preempt.resume_command(tmp_path) == f"kiln train {tmp_path}"
    monkeypatch.setattr(preempt.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(preempt.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert preempt.resume_command(tmp_path) == f"kiln train {tmp_path} --nproc 4"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes
    assert preempt.resume_command(tmp_path) == f"kiln train {tmp_path} under torchrun on every node, as this job " \
                                               "was started"


def test_a_rank_that_got_no_signal_names_the_one_another_rank_got(monkeypatch):
    """Ctrl-C (SIGINT) to rank 1 alone: rank 0, which says how the run stopped, said 'stopped by SIGTERM'."""
    import kiln.state.preempt as preempt

    def all_reduce(tensor, op=None, group=None):  # rank 1's SIGINT is the maximum
        tensor[0] = max(float(tensor[0]), float(signal.SIGINT))

    monkeypatch.setattr(preempt.dist, "all_reduce", all_reduce)
    guard = preempt.SignalGuard(group=object())
    assert guard.should_stop() == "SIGINT"
