"""Failures across processes: one rank's error stops every rank at once, and a hung rank is named.

A background thread in each process polls the run's key-value store (torchrun's TCPStore):

- A rank that raises records `rank R: error` there before it exits (first writer wins). The other
  ranks see it within a poll and exit quietly, instead of each printing a secondary error from a
  broken collective or waiting for the collective timeout: the error is shown once, by its rank.
  Each says it has seen it (a counter in the store), and the failing rank waits for that (at most
  ACK_WAIT_S) before it exits; rank 0, which serves the store, waits in turn until the failing rank
  is done with the store. A process leaving early would take the store from a rank still using it
  (torch prints C++ stack frames for each call) or let a rank's broken collective find no failure
  recorded and report itself as the cause.
- With `dist.watchdog_s`, the training loop counts its progress (`beat()`, a local counter) and
  publishes it about once a second. A rank whose own count has not moved for watchdog_s looks at
  every rank's count: the ranks with the lowest count are stuck (the others wait for them in a
  collective). A stuck rank prints the stacks of all its threads and records the
  failure; every rank then exits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from kiln.parallel.env import env_int

POLL_S = 0.5
ACK_WAIT_S = 4 * POLL_S + 1.0  # how long a failing rank waits for the others to see its failure
EXIT_CODE = 1
STOPPED = ("Interrupted:", "KeyboardInterrupt:")  # a rank's "failure" that is a SIGTERM/SIGINT (kiln.state.preempt)

_active: Watch | None = None


def beat() -> None:
    """The training loop made progress (called once per micro-batch; a local increment)."""
    if _active is not None:
        _active.count += 1


class Watch:
    def __init__(self, rank: int, world: int, watchdog_s: float, store=None, log: Callable[[str], None] = print,
                 exit_fn: Callable[[int], None] = os._exit):
        self.rank, self.world, self.watchdog_s = rank, world, watchdog_s
        self.log, self.exit = log, exit_fn
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"kiln/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}/"
        self.store = store if store is not None else _client_store()
        self.count, self._seen, self._since = 0, -1, time.monotonic()
        self._published, self._said = 0.0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kiln-watch", daemon=True)

    # ------------------------------------------------------------------ main thread

    def start(self) -> Watch:
        global _active
        _active = self
        self._thread.start()
        return self

    def stop(self) -> None:
        global _active
        _active = None
        self._stop.set()
        self._thread.join(timeout=5)

    def record_failure(self, error: BaseException, clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep) -> bool:
        """Tell the other ranks this one failed (the first failure recorded wins) and, if it was first, wait
        (at most ACK_WAIT_S) until each has seen it; then this rank uses the store no more (`released`).
        False when another rank's failure came first (the same error on every rank: that rank shows it, and
        this one stops like the rest, through `stopping`)."""
        self._stop.set()  # this rank is leaving: its watcher polls no more
        message = f"rank {self.rank}: {type(error).__name__}: {error}"
        try:
            if self.store.compare_set(self.prefix + "failed", "", message).decode() != message:
                return False
            self._wait_for("seen", self.world - 1, clock, sleep)
            self.store.add(self.prefix + "released", 1)
        except Exception:  # the store is gone (the agent stopped): nothing to tell
            pass
        return True

    def report(self, error: BaseException) -> bool:
        """This rank raises `error`: True if it is the run's failure (recorded; the caller shows it), False
        if another rank's failure came first, of which this is a consequence or a copy (the same config
        error on every rank): then this rank has said it stops, and exits without showing `error`."""
        other = self.failure()
        if (other is not None and not other.startswith(f"rank {self.rank}:")) or not self.record_failure(error):
            self.stopping(self.failure() or "")
            return False
        return True

    def stopping(self, failed: str) -> None:
        """Say (once) that this rank stops because another failed, and tell the failed rank it was seen."""
        if not self._said:
            self._said = True
            who, _, rest = failed.partition(": ")
            if not rest.startswith(STOPPED):  # a rank stopped by a signal failed nothing: its message says so
                print(f"rank {self.rank}: stopping, because {self._where(who, rest)}", file=sys.stderr, flush=True)
            self._acknowledge()

    def _where(self, who: str, error: str) -> str:
        """Why this rank stops, `who` ("rank R") having failed: on this node its error follows in the same log (the
        failed rank shows it once every rank has seen the failure, `record_failure`);
        on another node (nodes of LOCAL_WORLD_SIZE ranks) it is in that node's log only, so `error` is repeated."""
        per_node = max(1, env_int("LOCAL_WORLD_SIZE", self.world))
        failed = who.removeprefix("rank ")
        if not failed.isdigit() or int(failed) // per_node == self.rank // per_node:
            return f"{who} failed (its error follows)"
        return f"{who}, on node {int(failed) // per_node}, failed: {error}"

    def _acknowledge(self, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> None:
        """Count this rank as having seen the failure. Rank 0 serves the store (torchrun's environment from
        kiln): it then waits for the failed rank to be done with the store before this process may exit."""
        try:
            self.store.add(self.prefix + "seen", 1)
            if self.rank == 0:
                self._wait_for("released", 1, clock, sleep)
        except Exception:
            pass

    def _wait_for(self, key: str, count: int, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        end = clock() + ACK_WAIT_S
        while self.store.add(self.prefix + key, 0) < count and clock() < end:
            sleep(0.05)

    def failure(self) -> str | None:
        key = self.prefix + "failed"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:
            return None

    # ------------------------------------------------------------------ watcher thread

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            failed = self.failure()
            if failed is not None and not failed.startswith(f"rank {self.rank}:"):
                self.stopping(failed)
                self.exit(EXIT_CODE)
                return
            if self.watchdog_s > 0:
                self._check_progress()

    def _check_progress(self) -> None:
        if self.count == 0:  # not training yet (preparing data, loading a checkpoint): nothing to measure
            return
        now = time.monotonic()
        if self.count != self._seen:
            self._seen, self._since = self.count, now
        if now - self._published >= 1.0:
            self._published = now
            self.store.set(f"{self.prefix}beat/{self.rank}", str(self.count))
        if now - self._since < self.watchdog_s:
            return
        counts = {}
        for r in range(self.world):
            key = f"{self.prefix}beat/{r}"
            counts[r] = int(self.store.get(key)) if self.store.check([key]) else -1
        low = min(counts.values())
        stuck = sorted(r for r, c in counts.items() if c == low)
        names = ", ".join(map(str, stuck))
        if self.rank in stuck:
            print(f"\nkiln watchdog: rank {self.rank} made no progress for {self.watchdog_s:.0f} s (dist.watchdog_s); "
                  f"stuck rank(s): {names}. Stacks of its threads:", file=sys.stderr, flush=True)
            print(thread_stacks(), file=sys.stderr, flush=True)
            self.store.compare_set(self.prefix + "failed", "", f"rank {stuck[0]}: no progress for "
                                   f"{self.watchdog_s:.0f} s (stuck rank(s): {names})")
            self.exit(EXIT_CODE)
        elif now - self._since >= self.watchdog_s + 10 * POLL_S:  # the stuck rank could not report itself
            self.store.compare_set(self.prefix + "failed", "", f"rank {stuck[0]}: no progress for "
                                   f"{self.watchdog_s:.0f} s and no report from it (stuck rank(s): {names})")


def thread_stacks() -> str:
    """The Python stack of every thread of this process, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _client_store():
    """A connection of our own to torchrun's store (the default group's client serves the collectives)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        try:
            return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30),
                                 use_libuv=True)
        except Exception:
            pass
    return dist.distributed_c10d._get_default_store()
