"""DCP file-system storage, tuned: data files hashed while they are written, and read in parallel.

- `HashingFileSystem`: the writer's file system; the sha256 of every `.distcp` data file is computed
  from the bytes as they go to disk, so a save does not read its files back to hash them. A file
  written out of order (a seek) is left to be hashed from disk.
- `ParallelFileSystemReader`: a checkpoint holds `checkpoint.write_threads` data files per process;
  the stock reader reads them one after the other. Each file's requests go through the stock
  reader's own `read_data`, so the format stays DCP's; only the files are spread over threads.
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


class _HashingStream:
    """A write stream that hashes what passes through it; everything else goes to the file."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.in_order = f, hashlib.sha256(), 0, True

    def write(self, data) -> int:
        n = self.f.write(data)
        self.sha.update(memoryview(data)[:n] if n is not None else data)
        self.size += len(memoryview(data)[:n]) if n is not None else len(data)
        return n

    def seek(self, *args):
        self.in_order = False
        return self.f.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class HashingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}  # file name -> {"bytes", "sha256"}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as f:
            if "w" not in mode or not str(path).endswith(".distcp"):
                yield f
                return
            stream = _HashingStream(f)
            yield stream
            if stream.in_order:
                with self._lock:
                    self.digests[os.path.basename(str(path))] = {"bytes": stream.size,
                                                                 "sha256": stream.sha.hexdigest()}


def hashing_writer(path, threads: int, fsync: bool) -> dcp.FileSystemWriter:
    """DCP's writer with `HashingFileSystem` (its digests are in `writer.fs.digests` after the save)."""
    writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=fsync)
    if isinstance(getattr(writer, "fs", None), FileSystem):
        writer.fs = HashingFileSystem()
    return writer


class ParallelFileSystemReader(dcp.FileSystemReader):
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
