"""The memory tier: the whole state of a run at one step, in CPU memory, for rollback without the disk.

`take(parts, step)` copies every part (tensors into CPU buffers reused from one snapshot to the next,
pinned on CUDA; the small parts as detached JSON-safe copies); `restore(parts)` loads them back, so
weights, optimizer moments, schedule, loader position, counters and random generators are what they
were at that step. A snapshot survives its restores (it can be restored again). The copy uses the
checkpointer's staging (staging.py) with its own buffers, so a snapshot never shares memory with a
checkpoint still being written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.errors import StateError
from kiln.state.parts import RANK_KEYS, SMALL_KEYS, TENSOR_KEYS, as_parts
from kiln.state.staging import CpuStaging, clone_tree, json_copy, stage


@dataclass
class Snapshot:
    step: int
    tensors: dict[str, Any]  # "model", "optim": CPU copies
    small: dict[str, Any]  # "scheduler", "loader", "trainer", "rng": JSON-safe copies


class MemorySnapshots:
    def __init__(self, log=print):
        self.log = log
        self.snapshot: Snapshot | None = None
        self._stager = None

    def take(self, state) -> Snapshot:
        """Copy the whole state (a Trainer, or a dict of parts under the fixed keys) into CPU memory."""
        parts = as_parts(state)
        tensors = {k: parts[k].state_dict() for k in TENSOR_KEYS}
        if self._stager is None:
            self._stager = CpuStaging()
        self._stager, staged = stage(self._stager, tensors, self.log)
        small = json_copy({k: parts[k].state_dict() for k in SMALL_KEYS + RANK_KEYS})
        self.snapshot = Snapshot(int(small["trainer"]["step"]), staged, small)
        return self.snapshot

    def restore(self, state) -> int:
        """Load the last snapshot into `state` (a Trainer, or parts). Returns the step it was taken at."""
        if self.snapshot is None:
            raise StateError("no in-memory snapshot to roll back to; set checkpoint.snapshot_every")
        parts = as_parts(state)
        s = self.snapshot
        for key in TENSOR_KEYS:  # fresh copies: the loaded state must not share the snapshot's buffers
            parts[key].load_state_dict(clone_tree(s.tensors[key]))
        for key in SMALL_KEYS + RANK_KEYS:
            parts[key].load_state_dict(json.loads(json.dumps(s.small[key])))
        return s.step

    def close(self) -> None:
        self.snapshot, self._stager = None, None
