"""Batched encoding of documents to flat token arrays, in this process or in a pool of workers.

`Encoder.submit(tag, texts)` queues a batch; `Encoder.results()` gives `(tag, tokens, lengths)` in
submission order, where `tokens` is the batch's documents back to back, each with BOS (if set) and
EOS, and `lengths` their token counts. At most a few batches per worker are in flight, so memory
stays bounded whatever the input size. Special-token text inside a document is encoded as plain
text unless `parse_special` (see `Tokenizer.document_encoder`). Workers are spawned (not forked) and import only numpy and
tokenizers, so starting them is cheap and safe after torch or Rust threads exist in the parent.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from itertools import chain

import numpy as np

_state: dict = {}


def _init(tokenizer_json: str, parse_special: bool, eos_id: int, bos_id: int | None, dtype: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(tokenizer_json)
    tk.encode_special_tokens = not parse_special
    _state.update(tk=tk, eos=eos_id, bos=bos_id, dtype=np.dtype(dtype))


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
        self.args = (tokenizer.to_str(), parse_special, tokenizer.eos_id, tokenizer.bos_id, np.dtype(dtype).name)
        self.local = None
        self.pool = None
        self.pending: deque = deque()
        self.max_pending = 4 * workers + 2
        if workers > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init,
                                            initargs=self.args)
        else:
            self.local = (tokenizer.document_encoder(parse_special), tokenizer.eos_id, tokenizer.bos_id,
                          np.dtype(dtype))

    def submit(self, tag, texts: list[str]) -> None:
        if self.pool is None:
            self.pending.append((tag, encode_texts(texts, *self.local)))
        else:
            self.pending.append((tag, self.pool.submit(encode_texts, texts)))

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
                    from kiln.errors import ResourceError

                    raise ResourceError("a tokenizer worker process died (killed, or out of memory?); run again "
                                        "with fewer data.workers; finished shards are kept") from None
            self.pending.popleft()
            yield (tag, *item)

    def close(self, cancel: bool = False) -> None:
        """Shut the workers down; with `cancel`, drop queued batches and stop the workers at once."""
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        if cancel:
            # a pool broken by a dead worker can hang in shutdown(wait=True) on the survivors
            for proc in list((pool._processes or {}).values()):
                proc.terminate()
        pool.shutdown(wait=not cancel, cancel_futures=cancel)
