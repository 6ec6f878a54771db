"""An exclusive lock between processes on one machine, on a lock file: work that many processes may
start at once (every rank of a run preparing the same data) is done by the first, the others wait
and then find it done. Without fcntl (Windows) there is no lock."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, waiting_message: str | None = None, console=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if console is not None and waiting_message:
                console.print(waiting_message)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
