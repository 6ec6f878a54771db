"""Retention of local checkpoints, and room on the disk for the next one.

`KeepLast(n)`: once a checkpoint is complete, the oldest ones beyond the newest n are deleted (renamed
to `.tmp-del-...` first, so a kill during the delete leaves only a temporary directory that the next
resume removes), except those another policy still holds (checkpoints waiting for the archive).

Before a save, `check_room` compares the free space of the checkpoint directory with the size of the
newest checkpoint (or, before the first one, the size of the state). When it is short, retention may
delete early what it would delete anyway once the new checkpoint is complete, but never the newest
complete checkpoint: until the new one is complete it is the only sure way back (a save can still
fail or be killed). So with keep_last=1 the disk must hold two checkpoints during a save, and lowering
keep_last is only suggested when it would really free enough. When the room cannot be made the save
does not start: a StateError says how much is needed and what helps, and the checkpoints stay intact.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from kiln.errors import StateError
from kiln.state.policy import CheckpointPolicy
from kiln.state.rundir import CHECKPOINTS, TMP_PREFIX, checkpoints, set_aside, step_of
from kiln.state.verify import read_meta

MARGIN = 0.05  # a checkpoint may grow a little between saves (JSON parts, a new optimizer state)


def size_of(path: Path) -> int:
    """Bytes of a checkpoint: its meta.json's count, else what is on disk."""
    try:
        return int(read_meta(path)["bytes"])
    except (StateError, KeyError, TypeError, ValueError):
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def free_bytes(path: Path) -> int:
    """Free space of the file system holding `path` (its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _delete(path: Path) -> None:
    doomed = path.with_name(f"{TMP_PREFIX}del-{path.name}")
    os.rename(path, doomed)  # gone at once; a kill during the delete leaves only a .tmp- dir
    shutil.rmtree(doomed, ignore_errors=True)


class KeepBest(CheckpointPolicy):
    """Holds the local checkpoint with the lowest validation loss (from meta.json) against `KeepLast`, so the
    best checkpoint survives however many newer ones come (checkpoint.keep_best)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.best: tuple[float, str] | None = None
        for path in checkpoints(self.run_dir):  # a resume: the best among those already there
            try:
                self._consider(path, read_meta(path))
            except StateError:
                continue

    def _consider(self, path: Path, meta: dict) -> None:
        val = meta.get("val_loss")
        if val is not None and (self.best is None or val < self.best[0]):
            self.best = (float(val), path.name)

    def after_save(self, path: Path, meta: dict) -> None:
        self._consider(path, meta)

    def holds(self) -> set[str]:
        if self.best is None or not (self.run_dir / CHECKPOINTS / self.best[1]).is_dir():
            return set()
        return {self.best[1]}

    def room_advice(self, shortfall: int) -> list[str]:
        """Why a checkpoint older than the newest is still on the disk, when it is this policy's doing."""
        found = checkpoints(self.run_dir)
        if not self.holds() or not found or found[-1].name == self.best[1]:
            return []
        size = size_of(self.run_dir / CHECKPOINTS / self.best[1])
        return [f"{self.best[1]} ({human(size)}) is kept by checkpoint.keep_best, as the lowest validation loss so far "
                f"({self.best[0]:.4f}), beside the newest, so the disk holds three checkpoints during a save, not two; "
                f"checkpoint.keep_best=false lets it go{', which is enough' if size >= shortfall else ''}."]


class KeepLast(CheckpointPolicy):
    def __init__(self, run_dir: str | Path, keep_last: int, holders: Iterable[CheckpointPolicy] = (),
                 log: Callable[[str], None] = print):
        self.run_dir, self.keep_last, self.log = Path(run_dir), keep_last, log
        self.holders = list(holders)

    def _held(self) -> set[str]:
        return set().union(*(h.holds() for h in self.holders)) if self.holders else set()

    def after_save(self, path: Path, meta: dict) -> None:
        held = self._held()
        for old in checkpoints(self.run_dir)[: -self.keep_last]:
            if old != path and step_of(old) < step_of(path) and old.name not in held:
                _delete(old)

    def _early(self, keep_last: int) -> list[Path]:
        """Checkpoints that retention with `keep_last` deletes once the next one is complete, oldest
        first, but never the newest one (the way back until the next one is complete)."""
        found = checkpoints(self.run_dir)
        stay = max(keep_last - 1, 1)
        held = self._held()
        return [p for p in found[: max(len(found) - stay, 0)] if p.name not in held]

    def make_room(self, needed: int, free: int) -> int:
        freed = 0
        for old in self._early(self.keep_last):
            if free + freed >= needed:
                break
            size = size_of(old)
            _delete(old)
            freed += size
            self.log(f"removed {old.name} ({human(size)}) early to make room for the next checkpoint "
                     f"(checkpoint.keep_last={self.keep_last} removes it once the next one is complete)")
        return freed

    def room_advice(self, shortfall: int) -> list[str]:
        advice = []
        if self.keep_last > 1:
            more = sum(size_of(p) for p in self._early(1))
            if more >= shortfall:
                advice.append(f"Lowering checkpoint.keep_last to 1 would free {human(more)}, which is enough"
                              + self._best_later())
        aside = set_aside(self.run_dir)
        if aside:
            size = sum(size_of(p) for p in aside)
            names = ", ".join(p.name for p in aside)
            advice.append(f"{len(aside)} damaged checkpoint(s) set aside by a resume ({names}, {human(size)}) can "
                          "be deleted once inspected.")
        return advice

    def _best_later(self) -> str:
        """'.' when keep_last=1 leaves room for good; else why not: checkpoint.keep_best may keep an older best
        checkpoint beside the newest later, and the disk must then hold three checkpoints during a save."""
        if not any(isinstance(h, KeepBest) for h in self.holders):
            return "."
        found = checkpoints(self.run_dir)
        room = free_bytes(self.run_dir / CHECKPOINTS) + sum(size_of(p) for p in found)  # for checkpoints, all told
        three = 3 * int(size_of(found[-1]) * (1 + MARGIN)) if found else 0
        if room >= three:
            return " (also when checkpoint.keep_best keeps an older best checkpoint beside the newest)."
        return (" for now; but checkpoint.keep_best keeps the best checkpoint beside the newest when the newest is not "
                f"the best, and the disk then holds three checkpoints during a save ({human(three)}, with room for "
                f"{human(room)}): set checkpoint.keep_best=false too, or free more.")


def check_room(run_dir: Path, estimate: Callable[[], int], step: int, policies: list[CheckpointPolicy],
               log: Callable[[str], None]) -> tuple[int, int]:
    """StateError before a save that will not fit; policies make room first where that is safe.
    Returns (free bytes, bytes needed) when the save fits."""
    ckpt_dir = Path(run_dir) / CHECKPOINTS
    found = checkpoints(run_dir)
    base = size_of(found[-1]) if found else estimate()  # the state's size: only before the first checkpoint
    needed = int(base * (1 + MARGIN)) + (64 << 10)
    free = free_bytes(ckpt_dir)
    if free >= needed:
        return free, needed
    for policy in policies:
        if free >= needed:
            break
        policy.make_room(needed, free)
        free = free_bytes(ckpt_dir)
    if free >= needed:
        return free, needed
    found = checkpoints(run_dir)
    shortfall = needed - free
    what = (f"the newest checkpoint ({found[-1].name}, {human(size_of(found[-1]))})" if found else
            "the state of this run")
    kept = (f"Earlier checkpoints are intact (latest: {found[-1]}); it is kept until a new one is complete, so "
            "the disk must hold two checkpoints during a save. " if found else "No earlier checkpoint exists. ")
    advice = [a for p in policies for a in p.room_advice(shortfall)]
    raise StateError(
        f"disk full: the checkpoint of step {step} needs about {human(needed)} in {ckpt_dir} (the size of {what}), "
        f"and only {human(free)} are free. {kept}" + " ".join(advice) +
        (" " if advice else "") + f"Free {human(shortfall)} or more on that disk, or move the run directory to a "
        "larger disk (train.run_dir), then resume with `kiln train RUN_DIR`.")
