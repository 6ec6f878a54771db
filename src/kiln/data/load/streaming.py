"""Streaming mode: documents read, validated and tokenized while training, for data too large to prepare.

The stream is the documents of `data.sources` (the same readers and record checks as `kiln
prepare`) in source order (with `data.shuffle`, the files in a new seeded order each epoch), each
encoded as [BOS] ids EOS, back to back. Global row g is the window of T + 1 tokens starting at
token g*T of the stream; rank r of w takes rows r*B .. r*B + B - 1 of each global batch of w*B, as
the packed loader does. The position is (epoch, file, record, token offset in that document): a
resumed run reopens that file, skips to that record without decoding the ones before it where
the format allows, and continues at that token, whatever the number of ranks. The position also
holds the hash of that document's text: a resume whose sources changed (a file added, removed or
resized, or the record at the position now another document, say after an edit in place) is
refused rather than continued at a wrong place.

What streaming gives up: rows come in stream order (no global shuffle), every rank reads the whole
stream (and keeps its share), and exact-duplicate removal is off (it would need to remember
every document seen). Prepare the data when you can.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from kiln.data.load.prefetch import Prefetcher
from kiln.errors import FROM_THE_WEIGHTS, DataError, EmptySplit
from kiln.events import Callback

ENCODE_BATCH = 64  # documents tokenized together


def _sources(cfg):
    from kiln.data.read.sources import expand

    return expand(cfg.sources, cfg.format, cfg.dataset_split)


def _sources_key(files) -> str:
    h = hashlib.sha256()
    for sf in files:
        h.update(f"{sf.url}\0{sf.size}\0".encode())
    return h.hexdigest()[:16]


def streaming_tokenizer(cfg, console=None):
    """data.tokenizer, or a BPE trained on the first data.tokenizer_train_bytes of the sources (cached; progress
    on `console`)."""
    from kiln.data.prepare.bpe import sigterm_interrupts
    from kiln.data.prepare.cache import cache_errors, open_cache
    from kiln.data.prepare.keys import train_chars
    from kiln.data.prepare.tokenizer import Tokenizer, load_or_train
    from kiln.data.read.sources import iter_documents

    if cfg.tokenizer:
        tok = Tokenizer.load(cfg.tokenizer, cfg.eos_token, cfg.bos_token)
    else:
        files = _sources(cfg)
        limit = train_chars(cfg)

        def texts() -> Iterator[str]:
            total = 0
            for doc in iter_documents(cfg, files):
                yield doc.text
                total += len(doc.text)
                if total >= limit:
                    return

        cache = open_cache(cfg.cache_dir)
        with cache_errors(cache), sigterm_interrupts():
            tok = load_or_train(cfg, texts(), ["stream", _sources_key(files)], cache, console)
    if tok.eos_id is None:
        raise DataError("the tokenizer has no end-of-text token; set data.eos_token to one of its tokens")
    return tok


class StreamRows:
    """The deterministic core of the streaming loader: next batch of this rank, and the position."""

    def __init__(self, cfg, tokenizer, split: str, seq_len: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world: int = 1, document_mask: bool = True, shuffle: bool = True, pin_memory: bool = False,
                 per_step: int = 1):
        self.cfg, self.tok, self.split = cfg, tokenizer, split
        self.T, self.B, self.seed, self.rank, self.world = seq_len, batch_size, seed, rank, world
        self.per_step = per_step  # batches an optimizer step takes (recorded for check_resume_shape)
        self.document_mask, self.shuffle, self.pin = document_mask, shuffle, pin_memory
        self.encoder = tokenizer.document_encoder(cfg.parse_special_tokens)  # as prepare encodes documents
        self.files = _sources(cfg)
        self.key = _sources_key(self.files)
        self.position = {"epoch": 0, "file": 0, "record": 0, "offset": 0, "chars": 0, "sample": 0, "doc": None}
        from kiln.data.read.records import RecordChecker

        self.checker = RecordChecker.from_config(cfg)  # counts skips in the first epoch this process reads
        self.counted_epoch: int | None = None
        self._reset_buffer()

    # ------------------------------------------------------------------ documents

    def _order(self, epoch: int) -> list:
        if not self.shuffle:
            return self.files
        perm = np.random.default_rng([self.seed, epoch, 0x73747265]).permutation(len(self.files))
        return [self.files[i] for i in perm]

    def _documents(self, epoch: int, start: tuple[int, int], chars_before: int):
        """(epoch, file, record, chars_before, tokens, text hash) of this split's documents from `start` on,
        all epochs."""
        from kiln.data.prepare.encode import encode_texts
        from kiln.data.read.records import doc_hash, is_val
        from kiln.data.read.sources import iter_documents

        frac, limit, want_val = self.cfg.val_fraction, self.cfg.max_bytes, self.split == "val"
        while True:
            batch, found, total, read = [], False, chars_before, 0
            if self.counted_epoch is None:
                self.counted_epoch = epoch
            checker = self.checker if epoch == self.counted_epoch else None
            for doc in iter_documents(self.cfg, self._order(epoch), start=start, checker=checker):
                size = len(doc.text)  # data.max_bytes counts characters, as `kiln prepare` does
                h = doc_hash(doc.text)
                read += 1
                if is_val(h, frac) == want_val:
                    batch.append((doc.file_index, doc.record_index, total, doc.text, h))
                total += size
                if len(batch) >= ENCODE_BATCH:
                    yield from self._encode(epoch, batch, encode_texts)
                    found, batch = True, []
                if limit is not None and total >= limit:
                    break
            if batch:
                yield from self._encode(epoch, batch, encode_texts)
                found = True
            if not found and start == (0, 0):
                dropped = ", ".join(f"{n:,} {r}" for r, n in sorted(self.checker.dropped.items())) or "none"
                fix = "give more data or change data.val_fraction" if read else \
                    "every record was dropped: check the files, data.format and data.field"
                raise EmptySplit(f"the sources {self.cfg.sources} hold no '{self.split}' documents ({read:,} read, "
                                 f"dropped: {dropped}; data.val_fraction={frac}); {fix}")
            epoch, start, chars_before = epoch + 1, (0, 0), 0

    def _encode(self, epoch: int, batch: list, encode_texts):
        tokens, lengths = encode_texts([b[3] for b in batch], self.encoder, self.tok.eos_id, self.tok.bos_id, np.int64)
        for (fi, ri, before, _, h), doc in zip(batch, np.split(tokens, np.cumsum(lengths)[:-1])):
            yield epoch, fi, ri, before, doc, h

    def _reset_buffer(self) -> None:
        p = self.position
        if getattr(self, "_docs", None) is not None:
            self._docs.close()  # closes the file it was reading
        self._docs = None  # the generator, started on first use
        self._buf: deque = deque()  # (epoch, file, record, chars_before, tokens, hash) from the position on
        self._avail = 0  # tokens in the buffer from the position on
        self._skip = p["offset"]
        self._expect = p.get("doc")  # the hash of the document at the position, checked when it is read

    def _fill(self, need: int) -> None:
        if self._docs is None:
            p = self.position
            self._docs = self._documents(p["epoch"], (p["file"], p["record"]), p["chars"])
        while self._avail < need:
            item = next(self._docs)
            if self._expect is not None:
                if (item[1], item[2], item[5]) != (self.position["file"], self.position["record"], self._expect):
                    where = self._order(self.position["epoch"])[self.position["file"]].url
                    raise DataError(f"cannot resume the stream: record {self.position['record']} of {where} is "
                                    "not the document the run was reading; the source files changed since the "
                                    "checkpoint. Resume with the same files, or " + FROM_THE_WEIGHTS)
                self._expect = None
            if self._skip:  # resuming inside this document
                if item[4].size <= self._skip:
                    raise DataError(f"cannot resume the stream: document {item[1]}:{item[2]} is shorter than the "
                                    "saved offset; the source files changed since the checkpoint")
                item = (*item[:4], item[4][self._skip:], item[5])
                self._skip = 0
            self._buf.append(item)
            self._avail += item[4].size

    # ------------------------------------------------------------------ batches

    def next_batch(self):
        T, B, G = self.T, self.B, self.B * self.world
        need = G * T + 1
        self._fill(need)
        docs = list(self._buf)
        flat = np.concatenate([d[4] for d in docs])[:need]
        lo = self.rank * B * T
        rows = np.lib.stride_tricks.sliding_window_view(flat[lo:lo + B * T + 1], T + 1)[::T]  # (B, T+1)
        tokens = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        targets = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        np.copyto(tokens.numpy(), rows[:, :-1])
        np.copyto(targets.numpy(), rows[:, 1:])
        doc_ids = None
        if self.document_mask:
            starts = np.cumsum([0] + [d[4].size for d in docs[:-1]])  # document starts in flat
            which = np.searchsorted(starts, np.arange(lo, lo + B * T), side="right").reshape(B, T)
            doc_ids = torch.from_numpy((which - which[:, :1]).astype(np.int32))
            if self.pin:
                doc_ids = doc_ids.pin_memory()
        self._advance(G * T)
        return tokens, targets, doc_ids

    def _advance(self, n: int) -> None:
        """Move the position n tokens on, to the document and offset where the next batch starts."""
        off = self.position["offset"]
        while n:
            toks = self._buf[0][4]
            if toks.size <= n:
                self._buf.popleft()
                self._avail -= toks.size
                n -= toks.size
                off = 0
            else:
                self._buf[0] = (*self._buf[0][:4], toks[n:], self._buf[0][5])
                self._avail -= n
                off, n = off + n, 0
        self._fill(1)
        epoch, fi, ri, before, _, h = self._buf[0]
        self.position.update(epoch=epoch, file=fi, record=ri, chars=before, offset=off, doc=h,
                             sample=self.position["sample"] + self.B * self.world)

    def state_dict(self) -> dict:
        return {**self.position, "seq_len": self.T, "seed": self.seed, "split": self.split, "sources": self.key,
                "batch_size": self.B, "world": self.world, "per_step": self.per_step}

    def load_state_dict(self, state: dict) -> None:
        try:
            pos = {k: int(state[k]) for k in ("epoch", "file", "record", "offset", "chars", "sample")}
            pos["doc"] = None if state.get("doc") is None else int(state["doc"])  # absent in older saves
            seq_len, seed, key = int(state["seq_len"]), int(state["seed"]), str(state["sources"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"the saved streaming position is malformed ({e!r}); was it saved by a prepared-data "
                            "run? Resume with the same data.streaming setting") from None
        if seq_len != self.T or seed != self.seed:
            raise DataError(f"the saved stream position is for train.seq_len={seq_len}, train.seed={seed}; this run "
                            f"has {self.T} and {self.seed}. Resume with the saved values")
        from kiln.data.load.loader import check_resume_shape

        check_resume_shape(state, self.B, self.world, self.per_step)
        if key != self.key:
            raise DataError("the source files changed since the stream position was saved (names or sizes differ); "
                            "resume with the same data.sources, or " + FROM_THE_WEIGHTS)
        self.position = pos
        self._reset_buffer()


class StreamingLoader:
    """Iterator of (tokens, targets, doc_ids) batches tokenized on the fly; see the module doc.

    `replay` keeps the batches made since the start so `reset()` gives them again without reading
    (for evaluation, which reads the same few batches many times).
    """

    def __init__(self, cfg, tokenizer, split: str, seq_len: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world: int = 1, document_mask: bool = True, prefetch: int = 2, pin_memory: bool = False,
                 replay: bool | None = None, per_step: int = 1):
        self.rows = StreamRows(cfg, tokenizer, split, seq_len, batch_size, seed=seed, rank=rank, world=world,
                               document_mask=document_mask, shuffle=cfg.shuffle, pin_memory=pin_memory,
                               per_step=per_step)
        self._prefetch = Prefetcher(self.rows, prefetch, "kiln-stream") if prefetch > 0 else None
        self._start = self.rows.state_dict()
        self._state = self._start
        self._replay = [] if (split == "val" if replay is None else replay) else None
        self._at = 0  # batches given since the last reset
        self._recording = True  # the replay list holds every batch made since the start

    def __iter__(self) -> StreamingLoader:
        return self

    def __next__(self):
        if self._replay is not None and self._at < len(self._replay):
            batch, self._state = self._replay[self._at]
            self._at += 1
            return batch
        if self._prefetch is None:
            batch = self.rows.next_batch()
            self._state = self.rows.state_dict()
        else:
            batch, self._state = self._prefetch.next()
        if self._replay is not None and self._recording:
            self._replay.append((batch, self._state))
            self._at += 1
        return batch

    @property
    def dropped(self) -> dict[str, int]:
        """Records skipped (data.on_bad_record=skip) or filtered, by reason, in the first epoch read."""
        return dict(self.rows.checker.dropped)

    def state_dict(self) -> dict:
        return dict(self._state)

    def _move(self, state: dict) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()
        self.rows.load_state_dict(state)
        self._state = self.rows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._move(state)
        if self._replay is not None:
            self._replay, self._at, self._recording = [], 0, state == self._start

    def reset(self) -> None:
        """Back to the first batch."""
        if self._replay is not None and self._recording:
            self._at = 0  # replay what was made; the cursor waits at the end of it
            return
        self.load_state_dict(self._start)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()


class StreamDrops(Callback):
    """Says what a streaming run's reading dropped: records skipped under data.on_bad_record=skip, damaged
    files, filtered documents (`kiln prepare` puts them in its report). On the first logging step after the
    counts change, and at the end, a `data_dropped` notice (console, train.log, metrics.jsonl) gives the counts
    so far by reason, with examples; the counts are of the first epoch read, as later epochs read the same."""

    def __init__(self, loader):
        self.loader = loader
        self.said: dict[str, int] = {}

    def _say(self, trainer) -> None:
        checker = getattr(getattr(self.loader, "rows", None), "checker", None)
        if checker is None:
            return
        dropped = dict(checker.dropped)  # one copy, taken while the prefetch thread may count on
        if dropped == self.said:
            return
        self.said = dropped
        examples = {r: list(checker.examples.get(r, ())) for r in dropped}
        parts = [f"{n:,} {r} (e.g. {', '.join(examples[r])})" for r, n in sorted(dropped.items())]
        trainer.notice("data_dropped", dropped=dropped, examples=examples,
                       message=f"the stream has dropped {sum(dropped.values()):,} record(s) or file(s) so far "
                               f"(data.on_bad_record=skip and the filters): " + "; ".join(parts))

    def on_step_end(self, trainer, metrics) -> None:
        if metrics is not None:
            self._say(trainer)

    def on_train_end(self, trainer, metrics) -> None:
        self._say(trainer)

