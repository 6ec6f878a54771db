"""kiln.files: atomic writes, file hashes, and file_lock / try_lock (exclusive between processes,
released by a killed holder, no file left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from kiln.files import atomic_write, atomic_write_json, file_lock, hash_stream, sha256_file, try_lock

HOLD = """
import signal, sys
from pathlib import Path
from kiln.files import file_lock
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


def test_atomic_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "a.bin"
    atomic_write(path, b"old")
    atomic_write(path, [b"ne", memoryview(b"w!")])
    assert path.read_bytes() == b"new!"
    atomic_write(path, "text \u00e9")
    assert path.read_text(encoding="utf-8") == "text \u00e9"
    atomic_write_json(tmp_path / "m.json", {"b": 1, "a": [2]}, sort_keys=True)
    assert (tmp_path / "m.json").read_text() == '{"a": [2], "b": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "m.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write(path, "old")

    def chunks():
        yield b"half of the new"
        raise RuntimeError("the writer died")

    try:
        atomic_write(path, chunks())
    except RuntimeError:
        pass
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_sha256_of_a_file_and_of_a_stream(tmp_path):
    import hashlib

    data = os.urandom((8 << 20) + 123)  # more than one chunk
    (tmp_path / "x").write_bytes(data)
    assert sha256_file(tmp_path / "x") == hashlib.sha256(data).hexdigest()
    with open(tmp_path / "x", "rb") as f:
        f.read(10)
        h, n = hash_stream(f, chunk=1000)
    assert n == len(data) - 10 and h.hexdigest() == hashlib.sha256(data[10:]).hexdigest()
