"""Batched encoding of documents to flat token arrays, in this process or in a pool of workers.

`Encoder.submit(tag, texts)` queues a batch; `Encoder.results()` gives `(tag, tokens, lengths)` in
submission order, where `tokens` is the batch's documents back to back, each with BOS (if set) and
EOS, and `lengths` their token counts. At most a few batches per worker are in flight, so memory
stays bounded whatever the input size. Special-token text inside a document is encoded as plain
text unless `parse_special` (see `Tokenizer.document_encoder`).

Workers are forked on Linux (as PyTorch's DataLoader and Hugging Face datasets do) and spawned
elsewhere. A forked worker starts in milliseconds with the tokenizer already in memory, and does
not import the caller's script (a spawned one does: with torch at its top that costs seconds).
All workers are started when the Encoder is made, so the caller makes it before it starts threads
of its own (a progress bar's); the pool's own threads start after the fork. A worker ignores
SIGINT (the parent stops the pool), uses one thread (TOKENIZERS_PARALLELISM=false) and, on Linux,
is killed when its parent dies, so a parent killed with SIGKILL leaves no worker behind to hold
its files and locks. A spawned worker loads the tokenizer from a temporary file: the start message
sent to it stays small, so a worker that fails while starting (a script that calls prepare
without a `__main__` guard) breaks the pool with an error instead of blocking its parent on a full
pipe.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from itertools import chain

import numpy as np

START_METHOD = "fork" if sys.platform == "linux" else "spawn"

_state: dict = {}


def _init(tk, parse_special: bool, eos_id: int, bos_id: int | None, dtype: str, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal's, sent to the group: as Ctrl-C's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked: not the parent's handler (which raises)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    if isinstance(tk, str):  # spawned: the path of the tokenizer's JSON
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(tk)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
        if os.getppid() != parent:  # it died before that call
            os._exit(1)
    tk.encode_special_tokens = not parse_special  # this process's copy (forked, or unpickled if spawned)
    _state.update(tk=tk, eos=eos_id, bos=bos_id, dtype=np.dtype(dtype))


def _started() -> None:
    """A first task for each worker: submitting it starts the worker."""


def encode_texts(texts: list[str], tk=None, eos: int | None = None, bos: int | None = None,
                 dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths) of `texts`: every document as [BOS] ids EOS, concatenated."""
    if tk is None:
        tk, eos, bos, dtype = _state["tk"], _state["eos"], _state["bos"], _state["dtype"]
    ids = [e.ids for e in tk.encode_batch_fast(texts, add_special_tokens=False)]
    body = np.fromiter([len(x) for x in ids], np.int64, len(ids))
    extra = 1 + (bos is not None)
    lengths = body + extra
    ends = np.cumsum(lengths)
    n_body = int(body.sum())
    tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    tokens[ends - 1] = eos
    mask = np.ones(tokens.size, bool)
    mask[ends - 1] = False
    if bos is not None:
        tokens[ends - lengths] = bos
        mask[ends - lengths] = False
    tokens[mask] = np.fromiter(chain.from_iterable(ids), dtype, n_body)
    return tokens, lengths


class Encoder:
    """Encodes batches in order, with `workers` processes (or in this one when workers <= 1)."""

    def __init__(self, tokenizer, dtype, workers: int, parse_special: bool = False):
        self.local = None
        self.pool = None
        self.tmp = None
        self.pending: deque = deque()
        self.max_pending = 4 * workers + 2
        if workers > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            tk = tokenizer.tk
            if START_METHOD != "fork":
                fd, self.tmp = tempfile.mkstemp(prefix="kiln-tokenizer-", suffix=".json")
                os.close(fd)
                tk.save(self.tmp)
                tk = self.tmp
            args = (tk, parse_special, tokenizer.eos_id, tokenizer.bos_id, np.dtype(dtype).name, os.getpid())
            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(START_METHOD), initializer=_init,
                                            initargs=args)
            for _ in range(workers):  # every worker starts now (forked at the first submit, spawned one by one)
                self.pool.submit(_started)
        else:
            self.local = (tokenizer.document_encoder(parse_special), tokenizer.eos_id, tokenizer.bos_id,
                          np.dtype(dtype))

    def submit(self, tag, texts: list[str]) -> None:
        if self.pool is None:
            self.pending.append((tag, encode_texts(texts, *self.local)))
        else:
            try:
                self.pending.append((tag, self.pool.submit(encode_texts, texts)))
            except BrokenProcessPool:
                raise _worker_died() from None

    def results(self, drain: bool = False) -> Iterator[tuple[object, np.ndarray, np.ndarray]]:
        """Finished batches in order; waits only while too many are in flight (or all, if drain)."""
        while self.pending:
            tag, item = self.pending[0]
            if self.pool is not None:
                if not (drain or len(self.pending) > self.max_pending or item.done()):
                    return
                try:
                    item = item.result()
                except BrokenProcessPool:
                    raise _worker_died() from None
            self.pending.popleft()
            yield (tag, *item)

    def close(self, cancel: bool = False) -> None:
        """Shut the workers down; with `cancel`, drop queued batches and stop the workers at once."""
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        if cancel:
            # a pool broken by a dead worker can hang in shutdown(wait=True) on the survivors
            procs = list((pool._processes or {}).values())
            for proc in procs:
                proc.kill()  # no handler, no exit code runs in the worker: it cannot be held up
            for proc in procs:
                proc.join()
            # a worker stopped while sending a result leaves half a message in the result pipe: the pool's
            # thread would wait for the rest forever (and the interpreter on it at exit). With every worker
            # gone, closing this process's end of the pipe makes that read end, and the pool break.
            pool._result_queue._writer.close()
            # and a batch half written to the task pipe, which no worker reads now, would hold the pool's feeder
            # thread (and the interpreter's exit, which joins it) in its write: closing the read end ends it
            pool._call_queue._reader.close()
        pool.shutdown(wait=not cancel, cancel_futures=cancel)
        if self.tmp is not None:
            os.unlink(self.tmp)
            self.tmp = None


def _worker_died() -> Exception:
    from kiln.errors import ResourceError

    return ResourceError("a tokenizer worker process died: killed, out of memory (run again with fewer "
                         "data.workers), or, if an error is printed above, it failed while starting (where "
                         "workers are spawned, as on macOS and Windows, call prepare() in a script under "
                         "`if __name__ == \"__main__\":`); finished shards are kept")
