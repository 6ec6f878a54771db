"""The archive policy: chosen checkpoints are copied to the archive in the background; training never waits.

Which checkpoints: every `archive_every`-th periodic one and the final one ("every"), and one with a
lower validation loss than the archive's best ("best", decided again when it is copied). A copy
that fails (the archive is read-only, full, unreachable, or a copy does not verify) is logged and
retried with exponential backoff (5 s doubling up to 5 min); the checkpoint waits in the queue, and
`KeepLast` does not delete it locally until it is archived. When the archive comes back, the queue is
copied oldest first. At start the queue is filled with the local checkpoints the rule chooses that
the archive lacks (missed by an earlier process). `close()` makes one last attempt and names what is
still not archived (the next start of the run archives it; of a finished run too: `archive_missed`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.config import CheckpointConfig
from kiln.state.archive import Archive
from kiln.state.policy import CheckpointPolicy
from kiln.state.rundir import checkpoints
from kiln.state.verify import read_meta


class Archiver(CheckpointPolicy):
    def __init__(self, archive: Archive, run_dir: str | Path, ccfg: CheckpointConfig,
                 log: Callable[[str], None] = print, base_delay: float = 5.0, max_delay: float = 300.0,
                 background: bool = True):
        self.archive, self.run_dir, self.ccfg, self.log = archive, Path(run_dir), ccfg, log
        self.base_delay, self.max_delay = base_delay, max_delay
        self.queue: dict[str, dict[str, Any]] = {}  # checkpoint name -> {"path", "reasons", "val_loss"}, oldest first
        self.failures = 0  # consecutive failed attempts (0: the archive works)
        self.delays: list[float] = []  # the backoff waits taken, for the record
        self._best: float | None = None
        self._lock = threading.Lock()  # guards the queue
        self._attempt = threading.Lock()  # one copy at a time (worker or flush)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._catch_up_done = False
        if background:
            self._thread = threading.Thread(target=self._run, name="kiln-archive", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ policy hooks

    def _wanted(self, meta: dict[str, Any]) -> list[str]:
        every, m = self.ccfg.every, self.ccfg.archive_every
        if meta.get("reason") == "final" or (m and every and meta.get("reason") == "periodic"
                                              and (meta["step"] // every) % m == 0):
            return ["every"]
        return []

    def after_save(self, path: Path, meta: dict[str, Any]) -> None:
        reasons = self._wanted(meta)
        val = meta.get("val_loss")
        if self.ccfg.archive_best and val is not None and (self._best is None or val < self._best):
            self._best = val
            reasons.append("best")
            with self._lock:  # an older best candidate still queued would be replaced at once: drop it
                for job in self.queue.values():
                    if "best" in job["reasons"]:
                        job["reasons"].remove("best")
                self.queue = {k: j for k, j in self.queue.items() if j["reasons"]}
        if reasons:
            with self._lock:
                self.queue[path.name] = {"path": path, "reasons": reasons, "val_loss": val}
            self._wake.set()

    def holds(self) -> set[str]:
        with self._lock:
            return set(self.queue)

    def room_advice(self, shortfall: int) -> list[str]:
        waiting = self.holds()
        if not waiting:
            return []
        return [f"{len(waiting)} checkpoint(s) ({', '.join(sorted(waiting))}) are kept until the archive "
                f"{self.archive.url} takes them; it is failing now, so make it writable again."]

    # ------------------------------------------------------------------ copying

    def catch_up(self) -> None:
        """Queue the local checkpoints the rule chooses that the archive lacks (an earlier process missed them)."""
        present = set(self.archive.list())
        try:
            self._best = self.archive.best_loss() if self._best is None else self._best
        except (OSError, ValueError):
            pass
        for path in checkpoints(self.run_dir):
            if path.name in present:
                continue
            reasons = self._wanted(read_meta(path))
            if reasons:
                with self._lock:
                    self.queue.setdefault(path.name, {"path": path, "reasons": reasons, "val_loss": None})
        self._catch_up_done = True

    def _copy(self, name: str, job: dict[str, Any]) -> None:
        path = job["path"]
        if not path.is_dir():
            self.log(f"archive: {path} is gone before it was archived; skipped")
            return
        for reason in job["reasons"]:
            if reason == "best":
                best = self.archive.best_loss()
                if best is not None and job["val_loss"] >= best:
                    continue
            self.archive.add(path, reason, job["val_loss"] if reason == "best" else None)

    def flush(self) -> bool:
        """Try to copy everything queued now, oldest first, in the calling thread. True when the queue is empty."""
        with self._attempt:
            try:
                if not self._catch_up_done:
                    self.catch_up()
                while True:
                    with self._lock:
                        if not self.queue:
                            break
                        name, job = next(iter(self.queue.items()))
                    self._copy(name, job)
                    with self._lock:
                        self.queue.pop(name, None)
                    if self.failures:
                        self.log(f"archive {self.archive.url} works again: {name} archived")
                    self.failures = 0
            except Exception as e:  # noqa: BLE001 - a background policy: whatever goes wrong, training goes on
                self.failures += 1
                if self.failures == 1:
                    self.log(f"archive {self.archive.url} failed ({type(e).__name__}: {e}); training goes on, and "
                             f"{', '.join(self.holds()) or 'the missed checkpoints'} will be archived when it works "
                             "again (retrying with backoff)")
                return False
            return True

    def _delay(self) -> float:
        return min(self.max_delay, self.base_delay * 2 ** (self.failures - 1))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.flush():
                self._wake.wait()
                self._wake.clear()
            else:
                delay = self._delay()
                self.delays.append(delay)
                self._stop.wait(delay)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self.flush():
            self.log(f"not archived (the archive {self.archive.url} is failing): {', '.join(sorted(self.holds()))}; "
                     f"they stay in the run directory and are archived when `kiln train {self.run_dir}` is run again")


def archive_missed(run_dir: Path, ccfg: CheckpointConfig, log: Callable[[str], None] = print) -> list[str]:
    """For a run that has finished (nothing to train, so no checkpointer starts): copy the checkpoints the archive
    rule chooses that the archive lacks (it failed until the run ended), and say so. Returns their names."""
    archiver = Archiver(Archive(ccfg.archive_url, run_dir.name), run_dir, ccfg, log, background=False)
    try:
        archiver.catch_up()
    except Exception as e:  # noqa: BLE001 - the archive is unreachable: the run is finished all the same
        log(f"the archive {ccfg.archive_url} cannot be read ({type(e).__name__}: {e}); checkpoints it may lack are "
            f"archived when `kiln train {run_dir}` is run again once it works")
        return []
    missed = sorted(archiver.holds())
    if not missed:
        return []
    if archiver.flush():
        log(f"archived {len(missed)} checkpoint(s) that missed the archive {ccfg.archive_url} when this run ended: "
            f"{', '.join(missed)}")
    else:
        log(f"still not archived (the archive {ccfg.archive_url} is failing): {', '.join(sorted(archiver.holds()))}; "
            f"they stay in the run directory; run `kiln train {run_dir}` again once the archive works")
    return missed
