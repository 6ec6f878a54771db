"""Background prefetch: a thread runs a cursor a few batches ahead of the training loop.

A cursor is any object with `next_batch()`, `state_dict()` and `load_state_dict()`. Each queued
batch travels with the cursor's state just after it, so the consumer's position is always the
batch it last took, never the batch the thread last made: saving mid-run loses and repeats nothing.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any

_DONE = object()
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # a daemon thread still inside torch when the interpreter shuts down aborts the process
    for p in list(_LIVE):
        p.stop()


class Prefetcher:
    """Produces (batch, state_after) pairs from `cursor` in a daemon thread, `depth` ahead."""

    def __init__(self, cursor: Any, depth: int, name: str = "kiln-prefetch"):
        self.cursor, self.depth, self.name = cursor, max(1, depth), name
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(self.depth)

    def _run(self, stop: threading.Event, q: queue.Queue) -> None:
        try:
            while not stop.is_set():
                item = (self.cursor.next_batch(), self.cursor.state_dict())
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, raised there with its traceback
            q.put((_DONE, e))

    def next(self) -> tuple[Any, dict]:
        if self._thread is None:
            self._stop = threading.Event()
            self._queue = queue.Queue(self.depth)
            self._thread = threading.Thread(target=self._run, args=(self._stop, self._queue),
                                            name=self.name, daemon=True)
            self._thread.start()
            _LIVE.add(self)
        batch, state = self._queue.get()
        if batch is _DONE:
            self._thread = None
            raise state
        return batch, state

    def stop(self) -> None:
        """Stop the thread and drop what it made; the cursor is then free to be moved."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread.join()
            self._thread = None
