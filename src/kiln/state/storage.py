"""DCP file-system storage, tuned: data files hashed while they are written, and read in parallel.

- `HashingFileSystem`: the writer's file system; the sha256 of every `.distcp` data file is computed
  from the bytes as they go to disk, so a save does not read its files back to hash them. A file
  written out of order (a seek) is left to be hashed from disk. A write that fails (a full disk) is
  recorded in `error` and the rest of the save's writes are dropped: DCP's writer threads finish
  quietly (no thread tracebacks on the console) and the checkpointer reports the error once.
- `ParallelFileSystemReader`: a checkpoint holds `checkpoint.write_threads` data files per process;
  the stock reader reads them one after the other. Each file's requests go through the stock
  reader's own `read_data`, so the format stays DCP's; only the files are spread over threads. Its
  `.metadata` is read without running code (`kiln.state.dcp_read.SafeFileSystemReader`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from kiln.state.dcp_read import SafeFileSystemReader


class _HashingStream:
    """A write stream that hashes what passes through it; everything else goes to the file.

    After a failed write (of this or another stream of the save) writes are dropped: the save is lost anyway."""

    def __init__(self, f, fs: HashingFileSystem):
        self.f, self.fs, self.sha, self.size, self.in_order = f, fs, hashlib.sha256(), 0, True

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B"))
        if self.fs.error is not None:
            return size
        try:
            n = self.f.write(data)
        except OSError as e:
            self.fs.fail(e)
            return size
        view = memoryview(data).cast("B")
        self.sha.update(view[:n] if n is not None else view)
        self.size += n if n is not None else size
        return n

    def flush(self) -> None:
        if self.fs.error is None:
            try:
                self.f.flush()
            except OSError as e:
                self.fs.fail(e)

    def seek(self, *args):
        self.in_order = False
        return self.f.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class HashingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}  # file name -> {"bytes", "sha256"}
        self.error: OSError | None = None  # the first failed write of the save
        self._lock = threading.Lock()

    def fail(self, error: OSError) -> None:
        with self._lock:
            self.error = self.error or error

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as f:
                yield f
            return
        stream = None
        try:
            with super().create_stream(path, mode) as f:
                stream = _HashingStream(f, self)
                yield stream
        except OSError as e:  # opening or closing (the last buffered bytes) failed
            self.fail(e)
            if stream is None:  # DCP writes on into nothing; the save reports the error when it returns
                with open(os.devnull, "wb") as null:
                    yield _HashingStream(null, self)
        if stream is not None and stream.in_order and self.error is None and str(path).endswith(".distcp"):
            with self._lock:
                self.digests[os.path.basename(str(path))] = {"bytes": stream.size, "sha256": stream.sha.hexdigest()}


def hashing_writer(path, threads: int, fsync: bool) -> dcp.FileSystemWriter:
    """DCP's writer with `HashingFileSystem` (its digests are in `writer.fs.digests` after the save)."""
    writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=fsync)
    if isinstance(getattr(writer, "fs", None), FileSystem):
        writer.fs = HashingFileSystem()
    return writer


class ParallelFileSystemReader(SafeFileSystemReader):
    def __init__(self, path, threads: int = 8):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan, planner) -> Future:
        try:
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        except (AttributeError, KeyError, TypeError):  # a DCP version laid out differently: read serially
            return super().read_data(plan, planner)
        if self.threads < 2 or len(per_file) < 2:
            return super().read_data(plan, planner)
        read = dcp.FileSystemReader.read_data
        with ThreadPoolExecutor(min(self.threads, len(per_file)), thread_name_prefix="kiln-read") as pool:
            jobs = [pool.submit(read, self, dataclasses.replace(plan, items=items), planner)
                    for items in per_file.values()]
            for job in jobs:
                job.result().wait()  # re-raises the first failure
        done: Future = Future()
        done.set_result(None)
        return done
