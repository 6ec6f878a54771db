"""What a checkpoint policy can do: the checkpointer calls these hooks; each policy is a small class.

The checkpointer (the mechanism) writes and reads checkpoints. Policies decide the rest:
`CheckpointEvery` (callback.py) when to save and snapshot, `KeepLast` (retention.py) what stays on
the local disk and how room is made for the next save, `Archiver` (archiver.py) what is copied to the
archive. Hooks run on rank 0 only; `after_save` runs in the checkpoint's background thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class CheckpointPolicy:
    def after_save(self, path: Path, meta: dict[str, Any]) -> None:
        """`path` is complete (renamed into place, meta.json and its digest written)."""

    def holds(self) -> set[str]:
        """Names of local checkpoints this policy still needs (retention must not delete them)."""
        return set()

    def make_room(self, needed: int, free: int) -> int:
        """Delete what may go before a save that needs `needed` bytes; returns the bytes freed."""
        return 0

    def room_advice(self, shortfall: int) -> list[str]:
        """Sentences for the disk-full message: what, within this policy, would help."""
        return []

    def close(self) -> None:
        """The run is over (or stopped): finish or report pending work."""
