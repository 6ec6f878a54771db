"""The failure watcher on a real in-process store: another rank's recorded failure stops this rank, and the
watchdog names the rank(s) whose progress is lowest."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import torch.distributed as dist

from kiln.parallel.peers import FAILED_NOTE, lost_peer, note_failure
from kiln.parallel.watch import ACK_WAIT_S, HANG_EXIT_CODE, Watch, _bounded, rest


def _watch(rank: int, store, watchdog_s: float = 0.0) -> tuple[Watch, threading.Event, list]:
    stopped, codes = threading.Event(), []

    def fake_exit(code: int) -> None:
        codes.append(code)
        stopped.set()

    return Watch(rank, 2, watchdog_s, store=store, exit_fn=fake_exit), stopped, codes


@contextlib.contextmanager
def watching(w: Watch) -> Iterator[Watch]:
    """`w`'s thread polling the store for the block."""
    w.start()
    try:
        yield w
    finally:
        w.stop()


def test_a_failure_recorded_by_one_rank_stops_the_other(capsys):
    store = dist.HashStore()
    w0, stopped0, codes0 = _watch(0, store)
    w1, _, _ = _watch(1, store)
    with watching(w0):
        w1.record_failure(RuntimeError("disk on fire"))
        w0.record_failure(RuntimeError("a consequence"))  # the first failure recorded wins
        assert stopped0.wait(10) and codes0 == [1]
    assert w0.failure() == "rank 1: RuntimeError: disk on fire"
    assert "rank 0: stopping, because rank 1 failed" in capsys.readouterr().err


def test_the_watchdog_blames_the_rank_with_the_least_progress(capsys):
    store = dist.HashStore()
    w1, stopped1, codes1 = _watch(1, store, watchdog_s=0.5)
    w1.frozen_min_s = 1.0
    w1.count = 5  # rank 1 trained a little, then hung
    alive = threading.Event()

    def rank_0_alive() -> None:  # rank 0 got further and waits for rank 1; its watch thread still beats
        tick = 0
        while not alive.wait(0.1):
            tick += 1
            store.set(f"{w1.prefix}beat/0", f"7 {tick}")

    beating = threading.Thread(target=rank_0_alive, daemon=True)
    beating.start()
    try:
        with watching(w1):
            assert stopped1.wait(20) and codes1 == [HANG_EXIT_CODE]
    finally:
        alive.set()
    err = capsys.readouterr().err
    assert "kiln watchdog: rank 1 made no progress" in err and "stuck rank(s): 1" in err
    assert "Thread MainThread" in err  # the stacks of every thread
    assert w1.failure().startswith("rank 1: hung: it made no progress")


def _stalled(rank: int, watchdog_s: float = 10.0) -> Watch:
    """A watch whose rank trained 5 micro-batches, first seen at time 0, its store answering at time 0."""
    w = Watch(rank, 2, watchdog_s, store=dist.HashStore())
    w.count = 5
    assert w.verdict(0.0) is None
    w._store_ok = 0.0
    return w


def test_a_store_that_stops_answering_names_rank_0_which_serves_it():
    """Rank 0 stopped (SIGSTOP): every call to the store it serves blocks for good, and the watch thread, the
    only one that judged, died silently or waited forever; the job hung with nothing printed."""
    w1 = _stalled(1)
    assert w1.verdict(9.0) is None  # not yet dist.watchdog_s without progress
    culprit, why, stuck = w1.verdict(11.0)
    assert culprit == 0 and stuck == [0]
    assert "the job's key-value store, which it serves, has not answered for 11 s" in why
    assert "rank 1 has made no progress for 11 s" in why


def test_a_peer_whose_heartbeat_stands_still_is_named_though_the_store_answers():
    """Rank 1 stopped (SIGSTOP) under DDP: rank 0 said only 'stopping, because rank 1 failed (its error
    follows)', and no error followed."""
    w0 = _stalled(0)
    w0._beats, w0._watched_from = {1: ("5 40", 4.0)}, 4.0  # rank 1's heartbeat, unmoved since time 4
    w0._store_ok = 10.5
    assert w0.verdict(8.0) is None  # not yet dist.watchdog_s without progress
    culprit, why, _ = w0.verdict(11.0)
    assert culprit == 1 and "no heartbeat from it for 7 s, and rank 0 has made no progress for 11 s" in why


def test_a_live_peer_with_the_lowest_count_is_left_to_report_itself():
    w0 = _stalled(0)
    w0._beats, w0._watched_from = {1: ("4 40", 10.8)}, 4.0  # rank 1 beats, and is a micro-batch behind
    w0._store_ok = 10.9
    assert w0.verdict(11.0) is None  # rank 1, alive, reports itself with its stacks
    w0._beats, w0._store_ok = {1: ("4 80", 30.0)}, 30.0  # alive still, its count unmoved
    culprit, why, _ = w0.verdict(30.5)  # and not reporting: named by rank 0 in the end
    assert culprit == 1 and "did not report it" in why


def test_a_store_call_that_never_returns_is_given_up_on():
    release = threading.Event()
    assert _bounded(lambda: release.wait(30) or "late", 0.2) is None
    release.set()
    assert _bounded(lambda: "at once", 5) == "at once"
    assert _bounded(lambda: 1 / 0, 5) is None


def test_a_collective_broken_by_a_peer_that_died_names_it_from_torchruns_note(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(FAILED_NOTE, str(tmp_path / "failed"))
    note_failure("rank 1 (pid 7) was killed by SIGKILL", 1)
    w0 = Watch(0, 2, 0.0, store=dist.HashStore())
    error = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer")
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert w0.report(error) is False  # not shown: no gloo traceback
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # torchrun's SIGTERM no longer cuts its line short
    finally:
        signal.signal(signal.SIGTERM, before)  # ignored, it is inherited by every process the tests start after
    assert capsys.readouterr().err == "rank 0: stopping, because rank 1 (pid 7) was killed by SIGKILL\n"
    assert w0.failure() is None  # nothing recorded: it is no failure of this rank
    assert lost_peer(RuntimeError("CUDA out of memory"), 0, 2) is None


def test_the_failing_rank_leaves_only_once_the_others_have_seen_its_failure(capsys):
    """Rank 0 serves the store: leaving at once, it took the store from rank 1 while rank 1 still polled it
    (torch printed C++ stack frames), or let rank 1's broken collective find no failure recorded."""
    store = dist.HashStore()
    w0, _, _ = _watch(0, store)
    w1, stopped1, codes1 = _watch(1, store)
    with watching(w1):
        w0.record_failure(RuntimeError("bad replicas"))
        assert "rank 1: stopping, because rank 0 failed" in capsys.readouterr().err  # before rank 0 went on
        assert store.add(f"{w0.prefix}seen", 0) == 1
        assert stopped1.wait(10) and codes1 == [1]


def test_the_failing_rank_waits_for_the_others_a_bounded_time():
    store = dist.HashStore()
    w0, _, _ = _watch(0, store)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    w0.record_failure(RuntimeError("bad replicas"), clock=lambda: now[0], sleep=sleep)  # rank 1 never answers
    assert ACK_WAIT_S <= now[0] < ACK_WAIT_S + 0.1
    w1, _, _ = _watch(1, store)
    now[0] = 0.0
    assert not w1.record_failure(RuntimeError("bad replicas"), clock=lambda: now[0], sleep=sleep)  # not first
    assert now[0] == 0.0 and w1.failure() == "rank 0: RuntimeError: bad replicas"  # no wait


def test_rank_0_which_serves_the_store_exits_only_once_the_failed_rank_is_done_with_it():
    """Rank 0 stopping at once for rank 1's failure took the store from rank 1, still waiting in it."""
    store = dist.HashStore()
    released_at_exit = []
    w0 = Watch(0, 2, 0.0, store=store, exit_fn=lambda code: released_at_exit.append(
        store.add(f"{w1.prefix}released", 0)))
    w1, _, _ = _watch(1, store)
    with watching(w0):
        w1.record_failure(RuntimeError("bad replicas"))
        w0._threads[0].join(10)
        assert released_at_exit == [1]
    now = [0.0]
    lone = Watch(0, 2, 0.0, store=dist.HashStore())
    lone._acknowledge(clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))  # no failed rank
    assert ACK_WAIT_S <= now[0] < ACK_WAIT_S + 0.1


def test_a_rank_stopped_by_a_signal_is_not_reported_as_failed(capsys):
    """SIGTERM during start-up: every rank got it, yet the others said 'stopping, because rank 1 failed (its
    error is above)' above rank 1's 'stopped before training; nothing changed'."""
    from kiln.state.preempt import Interrupted

    store = dist.HashStore()
    w0, stopped0, codes0 = _watch(0, store)
    w1, _, _ = _watch(1, store)
    with watching(w0):
        w1.record_failure(Interrupted(15, "SIGTERM during start-up: stopped before training"))
        assert stopped0.wait(10) and codes0 == [1]
    assert "failed" not in capsys.readouterr().err


def test_the_same_error_on_two_ranks_at_once_is_shown_by_the_rank_that_recorded_it_first(capsys):
    """A config error found after start-up (lora.rank without model.init_from) fails every rank at the same
    moment: both passed the 'did another fail?' look, and both printed it."""
    store = dist.HashStore()
    w0, _, _ = _watch(0, store)
    w1, _, _ = _watch(1, store)
    error = ValueError("lora.rank is set but model.init_from is not")
    assert w0.failure() is None and w1.failure() is None  # both look before either records
    done = []
    t = threading.Thread(target=lambda: done.append(w0.report(error)))
    t.start()  # rank 0 records first and waits for rank 1 to see it
    while w1.failure() is None:
        t.join(0.01)
    assert w1.record_failure(error) is False  # rank 1 recorded second: its copy is not the run's failure
    assert w1.report(error) is False
    t.join(10)
    assert done == [True]
    assert "rank 1: stopping, because rank 0 failed" in capsys.readouterr().err


def test_a_rank_stopping_for_a_failure_on_another_node_repeats_its_error(capsys, monkeypatch):
    """Two nodes of one process each: rank 1's error is printed in node 1's log only, and rank 0 said 'its error
    is above' in node 0's, where it is not."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    store = dist.HashStore()
    w0, stopped0, _ = _watch(0, store)
    w1, _, _ = _watch(1, store)
    with watching(w0):
        w1.record_failure(ValueError("data.sources: /data/x.jsonl does not exist"))
        assert stopped0.wait(10)
    assert "rank 0: stopping, because rank 1, on node 1, failed: ValueError: data.sources: /data/x.jsonl does not " \
           "exist" in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node: the error follows in the same log
    assert w0._where("rank 1", "ValueError: x") == "rank 1 failed (its error follows)"


def test_nothing_is_judged_once_training_is_over(monkeypatch):
    """Rank 0 writes model/ and samples alone while the others wait: a watchdog shorter than that named a hang in a
    run that had finished."""
    import kiln.parallel.watch as watch

    w = _stalled(1, watchdog_s=1.0)
    monkeypatch.setattr(watch, "_active", w)  # as Watch.start makes it, without its threads
    assert w.verdict(100.0) is not None  # still training: a stall is judged
    rest()  # as kiln.train.run says once training is over
    assert w.verdict(200.0) is None


class SilentStore:
    """A store whose host is stopped: a call never returns (here: for a minute)."""

    def __getattr__(self, name):
        return lambda *a, **k: threading.Event().wait(60)


def test_with_the_store_host_stopped_one_rank_reports_and_the_others_say_a_line(monkeypatch, capsys):
    """Every rank of a job finds the stopped store host alike, and each printed the whole report with its stacks."""
    import kiln.parallel.watch as watch

    monkeypatch.setattr(watch, "STORE_CALL_S", 0.2)
    codes = {}
    for rank in (1, 2, 3):
        w = Watch(rank, 4, 10.0, store=SilentStore(), exit_fn=lambda code, r=rank: codes.setdefault(r, code))
        w._act(0, "it stopped answering", [0])
    err = capsys.readouterr().err
    assert codes == {1: HANG_EXIT_CODE, 2: HANG_EXIT_CODE, 3: HANG_EXIT_CODE}
    assert err.count("Thread MainThread") == 1 and "kiln watchdog (rank 1): rank 0 hung" in err
    assert "kiln watchdog (rank 3): rank 0 hung: it stopped answering; rank 1 prints the report" in err
