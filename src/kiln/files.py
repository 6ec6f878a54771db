"""Files that are whole or absent, their hashes, and locks between processes.

    atomic_write(path, data)          bytes, str or buffers: a reader sees the old file or the new one
    atomic_write_json(path, obj)      the same for JSON
    replace_file(tmp, path)           publish a temporary file written elsewhere (fsync, rename, fsync dir)
    sha256_file(path)                 hex digest, read in 8 MiB chunks
    with file_lock(path): ...         wait for the lock of `path`
    with try_lock(path) as held: ...  take it only if no other process has it

The locks are operating-system locks on a lock file (flock on POSIX, LockFileEx on Windows, through
`filelock`), so the kernel releases them when their process dies, kill -9 included: a held lock
means a live process. The holder removes the file before it lets go, so no lock files are left
behind; a process that then gets the lock of the removed file sees that the path no longer names
it and locks the path anew, so two processes never both hold the lock of one path. Locks are per
open file, not per process: two threads of one process contend like two processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 8 << 20  # hashlib drops the GIL on chunks this large, so threads hash in parallel


# --------------------------------------------------------------------------- atomic writes


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in directory `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it (Linux: /proc; elsewhere the usual 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def default_mode(path: str | Path) -> None:
    """Give `path` the mode a new file gets here (0666 less the umask): safetensors and other writers of
    temporary files create them 0600, which left model.safetensors unreadable to the group that serves it."""
    os.chmod(path, 0o666 & ~umask())


def replace_file(tmp: str | Path, path: str | Path, fsync: bool = True) -> None:
    """Move the finished temporary file `tmp` to `path` in one step: its bytes reach the disk first,
    then the rename, then the directory entry (with `fsync`), so a crash leaves the old file or the new.
    The file gets the mode of a new file (`default_mode`), whatever wrote the temporary one."""
    default_mode(tmp)
    if fsync:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(Path(path).parent)


def write_failure(e: BaseException) -> str | None:
    """Why a file could not be written, when `e` is a writer's I/O error: an OSError (its strerror), or the error of
    a Rust writer (safetensors' SafetensorError, tokenizers' plain Exception), whose text ends in "(os error N)";
    None for anything else (a bug, to raise as it is)."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, Exception) and "(os error " in str(e):
        return str(e)
    return None


def temp_name(path: Path) -> Path:
    """A temporary name beside `path`, unique to this writer (`<name>.<pid>-<random>.tmp`)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def atomic_write(path: str | Path, data: bytes | str | Iterable[bytes | memoryview], fsync: bool = True) -> None:
    """Write `data` (bytes, UTF-8 text, or an iterable of buffers) to `path` through a temporary file
    and a rename: a reader, or a crash, never finds half of it."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, str):
                f.write(data.encode("utf-8"))
            elif isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                for chunk in data:
                    f.write(chunk)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj: Any, fsync: bool = True, **dump: Any) -> None:
    """`atomic_write` of `json.dumps(obj, **dump)`."""
    atomic_write(path, json.dumps(obj, **dump), fsync=fsync)


# --------------------------------------------------------------------------- hashes


def hash_stream(f: BinaryIO, h: Any = None, chunk: int = CHUNK) -> tuple[Any, int]:
    """Feed the rest of the open binary file `f` into `h` (a new sha256 by default): (h, bytes read)."""
    h = hashlib.sha256() if h is None else h
    n = 0
    while block := f.read(chunk):
        h.update(block)
        n += len(block)
    return h, n


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file."""
    with open(path, "rb") as f:
        return hash_stream(f)[0].hexdigest()


# --------------------------------------------------------------------------- locks between processes


def _acquire(path: Path, blocking: bool, on_wait: Callable[[], None] | None = None) -> int | None:
    """An open descriptor holding the lock of `path`, or None (not blocking, and another process has it)."""
    from filelock import lock_descriptor

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
        try:
            got = lock_descriptor(fd, blocking=False)
            if not got:
                if not blocking:
                    os.close(fd)
                    return None
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                lock_descriptor(fd, blocking=True, poll_interval=0.05)
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed this file as it let go: lock the path's new file


def _release(path: Path, fd: int) -> None:
    if sys.platform == "win32":  # an open file cannot be removed there: unlock, close, then remove if free
        from filelock import unlock_descriptor

        with suppress(OSError):
            unlock_descriptor(fd)
        os.close(fd)
        with suppress(OSError):  # fails while another process has it open (and perhaps locked): theirs now
            os.unlink(path)
        return
    try:
        os.unlink(path)  # while still held: no one else can hold a file this path names
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


@contextmanager
def file_lock(path: str | Path, waiting_message: str | None = None, console=None) -> Iterator[None]:
    """Hold the lock of `path` (waiting for it; `waiting_message` is printed to `console` if it must)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def on_wait() -> None:
        if console is not None and waiting_message:
            console.print(waiting_message)

    fd = _acquire(path, True, on_wait)
    try:
        yield
    finally:
        _release(path, fd)


@contextmanager
def try_lock(path: str | Path) -> Iterator[bool]:
    """Hold the lock of `path` if no other process has it; yields whether it is held."""
    path = Path(path)
    try:
        fd = _acquire(path, False)
    except FileNotFoundError:  # its directory is gone
        fd = None
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        _release(path, fd)
