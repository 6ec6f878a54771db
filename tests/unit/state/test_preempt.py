"""The training loop's signal guard: a process forked while it is active does not inherit its behaviour."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

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
