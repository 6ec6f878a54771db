"""Failures across processes: one rank's error stops every rank at once, and a hung rank is named.

A background thread in each process (`kiln-watch`) polls the run's key-value store (torchrun's TCPStore):

- A rank that raises records `rank R: error` there before it exits (first writer wins). The other
  ranks see it within a poll and exit quietly, instead of each printing a secondary error from a
  broken collective or waiting for the collective timeout: the error is shown once, by its rank.
  Each says it has seen it (a counter in the store), and the failing rank waits for that (at most
  ACK_WAIT_S) before it exits; rank 0, which serves the store, waits in turn until the failing rank
  is done with the store. A process leaving early would take the store from a rank still using it
  (torch prints C++ stack frames for each call) or let a rank's broken collective find no failure
  recorded and report itself as the cause.
- A rank whose collective broke because a peer's process ended (killed, or crashed without a word) says
  which rank ended and how (torchrun's note, kiln.parallel.peers), in a line, instead of gloo's traceback.
- With `dist.watchdog_s`, the training loop counts its progress (`beat()`, a local increment) and the
  watch thread publishes it with a heartbeat (a tick that moves with every poll, whatever the loop does).
  A second thread (`kiln-watchdog`) judges, and never touches the store: a call to a store whose host is
  stopped never returns, so the judge must not depend on it. A rank whose own count has not moved for
  watchdog_s names the culprit:
  - the store has not answered for the last half of that time: its host, rank 0, is stopped or frozen
    (SIGSTOP, a hung kernel call) and can say nothing itself;
  - a peer's heartbeat has not moved for that long: that peer's process is stopped or frozen;
  - else every process is alive and the ranks with the lowest count are stuck (the others wait for them in a
    collective): a stuck rank prints the stacks of all its threads itself.
  The rank with the verdict prints it (which rank, how long without progress, what this node's kernel says
  of that process, and the stacks of its own threads), records it for the other ranks and for torchrun's
  summary, and exits with HANG_EXIT_CODE; every rank then stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from kiln.parallel.env import env_int
from kiln.parallel.peers import broken_by_a_lost_peer, lost_peer, peer_state, process_state, state_words

POLL_S = 0.5
ACK_WAIT_S = 4 * POLL_S + 1.0  # how long a failing rank waits for the others to see its failure
STORE_CALL_S = 5.0  # longest wait for the store when a rank stops: a stopped host never answers
EXIT_CODE = 1
HANG_EXIT_CODE = 124  # as timeout(1) and kiln.monitor.hang: the job stopped because a rank made no progress
HUNG = "hung: "  # a recorded failure that is the watchdog's verdict ("rank R: hung: why")
STOPPED = ("Interrupted:", "KeyboardInterrupt:")  # a rank's "failure" that is a SIGTERM/SIGINT (kiln.state.preempt)
TIMED_OUT = ("Timed out waiting", "timed out after", "Socket Timeout")  # a collective's error at dist.timeout_s

_active: Watch | None = None


def beat() -> None:
    """The training loop made progress (called once per micro-batch; a local increment)."""
    if _active is not None:
        _active.count += 1


def rest() -> None:
    """Training is over: no progress is counted from here on, so none is judged (rank 0 alone writes model/ and
    samples while the other ranks wait for it, which a watchdog shorter than that took for a hang)."""
    if _active is not None:
        _active.count = 0


class Watch:
    frozen_min_s = 3.0  # a peer's heartbeat unmoved this long at least (and watchdog_s / 2) means a stopped process

    def __init__(self, rank: int, world: int, watchdog_s: float, store=None, log: Callable[[str], None] = print,
                 exit_fn: Callable[[int], None] = os._exit):
        self.rank, self.world, self.watchdog_s = rank, world, watchdog_s
        self.log, self.exit = log, exit_fn
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"kiln/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}/"
        # rank 0 serves the store, unless torchrun shares its own with the workers
        self.store_host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        self.store = store if store is not None else _client_store()
        self.count, self.tick = 0, 0
        self._seen, self._since = -1, time.monotonic()  # the judge's: own count last seen, and since when
        self._store_ok = time.monotonic()  # the last poll the store answered
        self._beats: dict[int, tuple[str, float]] = {}  # peers' heartbeats: rank -> (value, when it last moved)
        self._watched_from: float | None = None  # since when the peers' heartbeats are read
        self._said = False
        self.exit_code = EXIT_CODE  # of this process when `report` says it stops without showing its error
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="kiln-watch", daemon=True),
                         threading.Thread(target=self._judge, name="kiln-watchdog", daemon=True)]

    # ------------------------------------------------------------------ main thread

    def start(self) -> Watch:
        global _active
        _active = self
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        global _active
        _active = None
        self._stop.set()
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=1 if t.name == "kiln-watch" else 5)  # the store thread may wait on a stopped host

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
        error on every rank), or if a peer's process ended under it: then this rank has said why it stops,
        and exits without showing `error`. The store is given STORE_CALL_S at most: if its host is stopped,
        this rank shows its error without telling the others (they find the same)."""
        if isinstance(error, SystemExit):  # this rank chose to exit, and said why (kiln.state.preempt)
            self._stop.set()
            return False
        if broken_by_a_lost_peer(error):
            with contextlib.suppress(ValueError):  # torchrun's SIGTERM to the survivors: this rank is stopping
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lost = lost_peer(error, self.rank, self.world)
        if lost is not None:
            self._stop.set()
            print(f"rank {self.rank}: stopping, because {lost}", file=sys.stderr, flush=True)
            return False
        if isinstance(error, RuntimeError) and any(s in str(error) for s in TIMED_OUT):
            self._stop.set()
            self._timed_out(error)
            return False
        answer = _bounded(lambda: self._report(error), ACK_WAIT_S + STORE_CALL_S)
        return True if answer is None else answer

    def _timed_out(self, error: BaseException) -> None:
        """A collective of this rank waited dist.timeout_s for the others: say so in a line, naming the rank whose
        process this node sees stopped or stuck in the kernel, and stop with HANG_EXIT_CODE."""
        from kiln.parallel.launch.torchrun import record_error

        stuck = [r for r in range(self.world) if r != self.rank and (peer_state(r) or (0, ""))[1] in "TtD"]
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        if stuck:
            who, why = f"rank {stuck[0]}", f"a collective of rank {self.rank} timed out waiting for it; " \
                                             f"{state_words(stuck[0])}"
        else:
            who, why = "a rank", f"a collective of rank {self.rank} timed out waiting for the others ({first})"
        print(f"rank {self.rank}: stopping, because {who} hung (dist.timeout_s): {why}. Set dist.watchdog_s to "
              "have a hung rank named, with the stacks of its threads, sooner", file=sys.stderr, flush=True)
        record_error(f"{who} hung: {why}", HANG_EXIT_CODE, culprit=stuck[0] if stuck else None)
        self.exit_code = HANG_EXIT_CODE

    def _report(self, error: BaseException) -> bool:
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
            if rest.startswith(HUNG):
                print(f"rank {self.rank}: stopping, because {who} hung (the watchdog's report is above)",
                      file=sys.stderr, flush=True)
            elif not rest.startswith(STOPPED):  # a rank stopped by a signal failed nothing: its message says so
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
        try:
            return self._failed()
        except Exception:
            return None

    def _failed(self) -> str | None:
        key = self.prefix + "failed"
        return self.store.get(key).decode() if self.store.check([key]) else None

    # ------------------------------------------------------------------ watch thread: the store

    def _loop(self) -> None:
        host = peer_state(self.store_host) if self.store_host not in (None, self.rank) else None  # on this node
        while not self._stop.wait(POLL_S):
            if host is not None and process_state(host[0]) in (None, "Z", "X"):
                return  # the store's host ended: a call now would print torch's C++ frames; the collectives say it
            try:
                failed = self._failed()
                if failed is not None and not failed.startswith(f"rank {self.rank}:"):
                    self.stopping(failed)
                    self.exit(EXIT_CODE)
                    return
                if self.watchdog_s > 0:
                    self._publish()
                self._store_ok = time.monotonic()
            except Exception:  # no answer as it should be: the judge weighs for how long (this thread goes on)
                continue

    def _publish(self) -> None:
        """This rank's count and a heartbeat; while its own count stands still, the peers' too."""
        self.tick += 1
        self.store.set(f"{self.prefix}beat/{self.rank}", f"{self.count} {self.tick}")
        if not self.count or time.monotonic() - self._since < self.watchdog_s / 2:
            return
        now = time.monotonic()
        for r in range(self.world):
            key = f"{self.prefix}beat/{r}"
            if r == self.rank:
                continue
            value = self.store.get(key).decode() if self.store.check([key]) else ""
            if r not in self._beats or self._beats[r][0] != value:
                self._beats[r] = (value, now)
        if self._watched_from is None:
            self._watched_from = now

    # ------------------------------------------------------------------ watchdog thread: the verdict

    def _judge(self) -> None:
        while self.watchdog_s > 0 and not self._stop.wait(POLL_S):
            verdict = self.verdict(time.monotonic())
            if verdict is not None:
                self._stop.set()
                self._act(*verdict)
                return

    def verdict(self, now: float) -> tuple[int | None, str, list[int]] | None:
        """(culprit, why, stuck ranks) once this rank has made no progress for watchdog_s and knows why; the
        culprit is None when the store (torchrun's) stopped answering."""
        if self.count == 0:  # not training yet (preparing data, loading a checkpoint): nothing to measure
            return None
        if self.count != self._seen:
            self._seen, self._since, self._watched_from = self.count, now, None
            self._beats = {}
            return None
        stall = now - self._since
        if stall < self.watchdog_s:
            return None
        window = max(self.watchdog_s / 2, self.frozen_min_s)
        still = f"rank {self.rank} has made no progress for {stall:.0f} s"
        silent = now - self._store_ok
        if silent >= window:
            if self.store_host is None or self.store_host == self.rank:
                return None, f"the job's key-value store (torchrun's) has not answered for {silent:.0f} s; {still}", []
            host = self.store_host
            return host, (f"it stopped answering: the job's key-value store, which it serves, has not answered for "
                          f"{silent:.0f} s, and {still}"), [host]
        if self._watched_from is None or now - self._watched_from < window:
            return None
        beats = dict(self._beats)
        frozen = sorted(r for r, (_, moved) in beats.items() if now - moved >= window)
        if frozen:
            r = frozen[0]
            return r, f"it stopped answering: no heartbeat from it for {now - beats[r][1]:.0f} s, and {still}", frozen
        counts = {r: _count(value) for r, (value, _) in beats.items()}
        counts[self.rank] = self.count
        low = min(counts.values())
        stuck = sorted(r for r, c in counts.items() if c == low)
        if self.rank in stuck:
            return self.rank, f"it made no progress for {stall:.0f} s", stuck
        if stall >= self.watchdog_s + window + 10 * POLL_S:  # the stuck rank, alive, could not report itself
            return stuck[0], f"it made no progress (its count stands at {low}) and did not report it; {still}", stuck
        return None

    def _act(self, culprit: int | None, why: str, stuck: list[int]) -> None:
        """Print the verdict (once in the job, where the store can tell) and stop this process."""
        from kiln.parallel.launch.torchrun import record_error

        if culprit is not None and culprit != self.rank:
            kernel = state_words(culprit)
            why += f"; {kernel}" if kernel else ""
        who = f"rank {culprit}" if culprit is not None else "the store"
        message = f"rank {culprit if culprit is not None else self.rank}: {HUNG}{why}"
        first = _bounded(lambda: self.store.compare_set(self.prefix + "failed", "", message).decode() == message,
                         STORE_CALL_S)
        if first is False:  # another rank's verdict or failure came first: it has said it
            self.stopping(self.failure() or "")
            self.exit(EXIT_CODE)
            return
        names = ", ".join(map(str, stuck))
        reporter = min((r for r in range(self.world) if r != culprit), default=self.rank)
        if first is None and self.rank != reporter:  # no store to choose one reporter: the first rank after it reports
            print(f"kiln watchdog (rank {self.rank}): {who} hung: {why}; rank {reporter} prints the report",
                  file=sys.stderr, flush=True)
            record_error(f"{who} hung: {why}", HANG_EXIT_CODE, culprit=culprit)
            self.exit(HANG_EXIT_CODE)
            return
        if culprit == self.rank:
            print(f"\nkiln watchdog: rank {self.rank} made no progress for {self.watchdog_s:.0f} s (dist.watchdog_s); "
                  f"stuck rank(s): {names}. Stacks of its threads:", file=sys.stderr, flush=True)
        else:
            print(f"\nkiln watchdog (rank {self.rank}): {who} hung: {why}. Every rank stops (dist.watchdog_s="
                  f"{self.watchdog_s:g}). Stacks of rank {self.rank}'s threads, waiting for {who}:",
                  file=sys.stderr, flush=True)
        print(thread_stacks(skip=("kiln-watch", "kiln-store-call")), file=sys.stderr, flush=True)
        record_error(f"{who} hung: {why}", HANG_EXIT_CODE, culprit=culprit)
        self.exit(HANG_EXIT_CODE)


def _count(beat: str) -> int:
    """The progress count of a published heartbeat ("count tick"); -1 for none."""
    head = beat.split(" ", 1)[0]
    return int(head) if head.lstrip("-").isdigit() else -1


def _bounded(call: Callable[[], object], seconds: float) -> object | None:
    """`call()` in a thread of its own, waited for `seconds` at most: its answer, or None if it raised or did not
    answer in time (a store whose host is stopped never answers; the thread is left waiting)."""
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception:
            pass

    t = threading.Thread(target=run, name="kiln-store-call", daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else None


def thread_stacks(skip: tuple[str, ...] = ()) -> str:
    """The Python stack of every thread of this process, each headed by the thread's name (less the threads whose
    names start with one of `skip`)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if str(names.get(ident, "")).startswith(skip) and skip:
            continue
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
