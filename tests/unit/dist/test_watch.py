"""The failure watcher on a real in-process store: another rank's recorded failure stops this rank, and the
watchdog names the rank(s) whose progress is lowest."""

from __future__ import annotations

import threading

import torch.distributed as dist

from kiln.dist.watch import Watch


def _watch(rank: int, store, watchdog_s: float = 0.0) -> tuple[Watch, threading.Event, list]:
    stopped, codes = threading.Event(), []

    def fake_exit(code: int) -> None:
        codes.append(code)
        stopped.set()

    return Watch(rank, 2, watchdog_s, store=store, exit_fn=fake_exit), stopped, codes


def test_a_failure_recorded_by_one_rank_stops_the_other(capsys):
    store = dist.HashStore()
    w0, stopped0, codes0 = _watch(0, store)
    w1, _, _ = _watch(1, store)
    w0.start()
    try:
        w1.record_failure(RuntimeError("disk on fire"))
        w0.record_failure(RuntimeError("a consequence"))  # the first failure recorded wins
        assert stopped0.wait(10) and codes0 == [1]
    finally:
        w0.stop()
    assert w0.failure() == "rank 1: RuntimeError: disk on fire"
    assert "rank 0: stopping, because rank 1 failed" in capsys.readouterr().err


def test_the_watchdog_blames_the_rank_with_the_least_progress(capsys):
    store = dist.HashStore()
    w1, stopped1, codes1 = _watch(1, store, watchdog_s=0.5)
    store.set(f"{w1.prefix}beat/0", "7")  # rank 0 got further and waits for rank 1
    w1.count = 5  # rank 1 trained a little, then hung
    w1.start()
    try:
        assert stopped1.wait(10) and codes1 == [1]
    finally:
        w1.stop()
    err = capsys.readouterr().err
    assert "kiln watchdog: rank 1 made no progress" in err and "stuck rank(s): 1" in err
    assert "kiln-watch" in err or "Thread" in err  # faulthandler's stacks of every thread
    assert w1.failure().startswith("rank 1: no progress")
