"""DCP's file-system reader, reading a checkpoint's files in parallel (one thread per file).

A checkpoint holds `checkpoint.write_threads` data files per process; the stock reader reads them
one after the other. Each file's requests go through the stock reader's own `read_data`, so the
file format stays DCP's; only the files are spread over threads.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch.distributed.checkpoint as dcp
from torch.futures import Future


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
