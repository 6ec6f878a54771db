"""An exclusive lock between processes on one machine, on a lock file: work that many processes may
start at once (every rank of a run preparing the same data) is done by the first, the others wait
and then find it done. Without fcntl (Windows) there is no lock.

    with file_lock(path):               # waits for the lock
        ...
    with try_lock(path) as held:        # held: False when another process has it (no wait)
        ...

The lock is an flock on the file, so the kernel releases it when its process dies, kill -9 included:
a held lock means a live process. The holder removes the file before it lets go, so no lock files
are left behind; a process that then gets the lock on the removed file sees that the path no longer
names it and locks the path anew, so two processes never both hold the lock of one path.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def _acquire(path: Path, blocking: bool, on_wait=None):
    """An open file holding the lock on `path`, or None (not blocking, and another process has it)."""
    import fcntl

    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                f.close()
                return None
            if on_wait is not None:
                on_wait()
                on_wait = None
            fcntl.flock(f, fcntl.LOCK_EX)
        except BaseException:
            f.close()
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()  # the holder removed this file as it let go: lock the path's new file


def _release(path: Path, f) -> None:
    try:
        os.unlink(path)  # while still held: no one else can hold a file this path names
    except FileNotFoundError:
        pass
    finally:
        f.close()


@contextmanager
def file_lock(path: Path, waiting_message: str | None = None, console=None):
    """Hold the lock of `path` (waiting for it; `waiting_message` is printed to `console` if it must)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl  # noqa: F401
    except ImportError:
        yield
        return

    def on_wait():
        if console is not None and waiting_message:
            console.print(waiting_message)

    f = _acquire(path, True, on_wait)
    try:
        yield
    finally:
        _release(path, f)


@contextmanager
def try_lock(path: Path):
    """Hold the lock of `path` if no other process has it; yields whether it is held. Without fcntl,
    yields False (no process can tell whether another is at work)."""
    try:
        import fcntl  # noqa: F401
    except ImportError:
        yield False
        return
    try:
        f = _acquire(path, False)
    except FileNotFoundError:  # its directory is gone
        f = None
    if f is None:
        yield False
        return
    try:
        yield True
    finally:
        _release(path, f)
