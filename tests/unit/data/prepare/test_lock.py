"""file_lock / try_lock: exclusive between processes, released by a killed holder, no file left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from kiln.data.prepare.lock import file_lock, try_lock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fcntl: no lock")

HOLD = """
import signal, sys
from pathlib import Path
from kiln.data.prepare.lock import file_lock
with file_lock(Path(sys.argv[1])):
    print("held", flush=True)
    signal.pause()  # until killed
"""


def test_a_lock_held_by_a_live_process_then_freed_by_its_kill_9(tmp_path):
    path = tmp_path / "x.lock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with try_lock(path) as held:
            assert not held
        assert path.exists()  # the holder's file is left alone
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with try_lock(path) as held:
        assert held
    assert not path.exists()  # released: removed


def test_a_waiter_on_a_removed_lock_file_locks_the_path_anew(tmp_path):
    """The holder removes the file as it lets go; a waiter that got the lock of that removed file must
    not believe it holds the path's lock (then two processes could hold it at once)."""
    path = tmp_path / "x.lock"
    order, got, waiting, main_waits = [], threading.Event(), threading.Event(), threading.Event()

    def waiter():
        with file_lock(path, "waiting", EventConsole(waiting)):
            order.append("waiter")
            got.set()
            # hold the lock until the main thread waits for it
            order.append("waiter done" if main_waits.wait(10) else "main never waited")

    with file_lock(path):
        t = threading.Thread(target=waiter)
        t.start()
        assert waiting.wait(10)  # the waiter has opened the file and found it locked
        assert not got.is_set()
    assert got.wait(10)
    with try_lock(path) as held:  # the waiter holds the lock of the file the path names now
        assert not held
    with file_lock(path, "waiting", EventConsole(main_waits)):
        order.append("main")
    t.join()
    assert order == ["waiter", "waiter done", "main"]
    assert not path.exists()


class EventConsole:
    """A console for file_lock's waiting message: sets `event` when the lock is found taken."""

    def __init__(self, event: threading.Event):
        self.event = event

    def print(self, message: str) -> None:
        self.event.set()
