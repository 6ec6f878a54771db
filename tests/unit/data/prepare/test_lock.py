"""file_lock / try_lock: exclusive between processes, released by a killed holder, no file left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kiln.data.prepare.lock import file_lock, try_lock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fcntl: no lock")

HOLD = """
import sys, time
from pathlib import Path
from kiln.data.prepare.lock import file_lock
with file_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
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
    order, got = [], threading.Event()

    def waiter():
        with file_lock(path):
            order.append("waiter")
            got.set()
            time.sleep(0.3)
            order.append("waiter done")

    with file_lock(path):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)  # the waiter has opened the file and waits on it
        assert not got.is_set()
    assert got.wait(10)
    with try_lock(path) as held:  # the waiter holds the lock of the file the path names now
        assert not held
    with file_lock(path):
        order.append("main")
    t.join()
    assert order == ["waiter", "waiter done", "main"]
    assert not path.exists()
