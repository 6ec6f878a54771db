"""PackedLoader: fixed-length rows of packed documents, in a seeded order that resumes exactly.

Layout. A split's shards form one circular token stream of L tokens (documents end with EOS). In
epoch e a dataset has N = (L - 1) // T rows: row j is the window of T + 1 tokens starting at
(o_e + j*T) mod L, where o_e in [0, T) is a seeded per-epoch shift, so documents are cut at new
places every epoch; an epoch makes every token but fewer than T a target exactly once. Rows are
visited in a seeded permutation of [0, N)
(`kiln.data.load.order.permute`, O(1) memory), so the k-th sample of a dataset is a pure function of
(seed, dataset, k). Inputs are the first T tokens of a row, targets the last T.

Mixtures. Global sample g comes from dataset `Mixture.sources(g)`, a pure function of (seed, g);
the loader counts the samples taken from each dataset. A curriculum (`schedule`, a list of
kiln.data.load.schedule.Stage) changes the weights with g, still a pure function of (seed, g).

Ranks. A global batch is samples g .. g + B*world - 1; rank r takes the r-th slice of B. The state
holds the global position (next global sample, samples taken per dataset), identical on every
rank, so a run resumed on another number of ranks with the same global batch continues at the
same sample, with no token seen twice or skipped.

Resuming with another shape (`check_resume_shape`): another train.seq_len is refused (the rows
would be cut elsewhere). The state also records the batch it was saved with (B per rank, world, and
`per_step`: the batches an optimizer step takes, train.grad_accum or what train.global_batch_tokens
makes of it): a resume on another number of ranks with the same rows per rank and step would change
the global batch without anyone asking, so it is a ConfigError that names the train.batch_size
keeping the global batch (or says the global batch does not divide by the new number of ranks).
Other rows per rank and step (train.global_batch_tokens kept, or a batch changed on purpose, which
the checkpoint's config check asks --resume force for) is a defined continuation: the next batch
starts at the next global sample, and a step of the same global batch takes the same samples.

Each batch is (tokens, targets, doc_ids): int64 (B, T), int64 (B, T) and int32 (B, T) with the
index of each position's document within its row (None when document masking is off). With
`pin_memory` the tensors are in pinned memory, for non-blocking copies to the GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kiln.data.format.shards import TokenStream
from kiln.data.load.mixture import Mixture
from kiln.data.load.order import permute, round_keys
from kiln.data.load.prefetch import Prefetcher
from kiln.data.load.schedule import Schedule, Stage
from kiln.errors import FROM_THE_WEIGHTS, ConfigError, DataError

CHUNK = 4096  # row positions permuted at a time

Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def check_resume_shape(saved: dict, batch_size: int, world: int, per_step: int = 1) -> None:
    """ConfigError when a saved position is resumed on another number of ranks with the same rows per rank
    and optimizer step (batch_size x per_step; the global batch would change unasked). States saved before
    the batch was recorded pass; those saved before `per_step` was recorded count 1."""
    if "batch_size" not in saved or "world" not in saved:
        return
    b, w, n = int(saved["batch_size"]), int(saved["world"]), int(saved.get("per_step", 1))
    if w == world or b * n != batch_size * per_step:
        return
    g = b * n * w
    batch = f"{b} sequences per rank" + (f" x {n} accumulated" if n > 1 else "") + f" on {w} ranks ({g} in all)"
    if g % world:
        divisors = [str(k) for k in range(1, g + 1) if g % k == 0]
        raise ConfigError(f"the checkpoint's batch is {batch}, which {world} ranks cannot share evenly: resume on "
                          f"{', '.join(divisors)} ranks, or choose a new train.batch_size with --resume force (the "
                          "next batch starts at the next sample)")
    keep = g // world
    how = (f"train.batch_size={keep // per_step}" if keep % per_step == 0 else
           f"train.batch_size x train.grad_accum = {keep} (--resume force)")
    raise ConfigError(f"the checkpoint's batch is {batch}; on {world} rank(s) keep it with {how}, or keep "
                      f"train.batch_size={b} on {w} ranks")


class RowLayout:
    """Where the k-th sample of one dataset starts in its token stream."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int, shuffle: bool):
        self.stream, self.T, self.seed, self.shuffle = stream, seq_len, seed, shuffle
        self.L = len(stream)
        self.rows = (self.L - 1) // seq_len  # rows per epoch
        if self.rows < 1:
            raise DataError(f"dataset {stream.name} has {self.L} tokens, fewer than one row of train.seq_len + 1 = "
                            f"{seq_len + 1}; use more data or a shorter train.seq_len")
        self._stream_key = int.from_bytes(hashlib.blake2b(stream.name.encode(), digest_size=8).digest(), "little")
        self._epoch_keys: tuple = (-1, None)
        self._cache: tuple = (-1, 0, np.empty(0, np.int64))

    def _order(self, epoch: int, i: np.ndarray) -> np.ndarray:
        """Row j of each epoch position i, through a cache of CHUNK consecutive positions."""
        lo, hi = int(i.min()), int(i.max())
        c_epoch, c_lo, c_rows = self._cache
        if c_epoch != epoch or lo < c_lo or hi >= c_lo + c_rows.size:
            c_lo = lo - lo % CHUNK
            span = np.arange(c_lo, min(max(hi + 1, c_lo + CHUNK), self.rows))
            c_rows = permute(span, self.rows, self._keys(epoch)[0])
            self._cache = (epoch, c_lo, c_rows)
        return c_rows[i - c_lo]

    def _keys(self, epoch: int) -> tuple[np.ndarray, int]:
        """Permutation keys and row shift of an epoch."""
        if self._epoch_keys[0] != epoch:
            keys = round_keys(self.seed, self._stream_key, epoch)
            self._epoch_keys = (epoch, (keys, int(keys[0] % np.uint64(self.T))))
        return self._epoch_keys[1]

    def starts(self, k: np.ndarray) -> np.ndarray:
        """Stream offsets of samples k (int64 array of within-dataset indices)."""
        epoch, i = np.divmod(k, self.rows)
        if not self.shuffle:
            return (i * self.T) % self.L
        out = np.empty_like(k)
        for e in np.unique(epoch).tolist():
            sel = epoch == e
            out[sel] = (self._keys(e)[1] + self._order(e, i[sel]) * self.T) % self.L
        return out


class PackedRows:
    """The deterministic core: the next batch of this rank, and the global position."""

    def __init__(self, streams: Sequence[TokenStream], seq_len: int, batch_size: int, *, weights=None,
                 seed: int = 0, rank: int = 0, world: int = 1, document_mask: bool = True, shuffle: bool = True,
                 pin_memory: bool = False, per_step: int = 1, schedule: Sequence[Stage] | None = None):
        if not streams:
            raise DataError("the loader got no datasets to read")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        names = [s.name for s in streams]
        if len(set(names)) != len(names):
            raise DataError(f"the same dataset appears twice in the mixture: {names}; merge the entries")
        self.T, self.B, self.seed, self.rank, self.world = seq_len, batch_size, seed, rank, world
        self.per_step = per_step  # batches an optimizer step takes (recorded for check_resume_shape)
        self.document_mask, self.pin = document_mask, pin_memory
        dtypes = {s.dtype for s in streams}
        self.dtype = np.result_type(*dtypes)
        self.layouts = [RowLayout(s, seq_len, seed, shuffle) for s in streams]
        if schedule:
            self.mixture: Mixture | Schedule = Schedule(schedule, seed)
            if len(self.mixture) != len(streams):
                raise DataError(f"the schedule weighs {len(self.mixture)} datasets but the loader reads {len(streams)}")
        else:
            self.mixture = Mixture(weights if weights is not None else [1.0] * len(streams), seed)
        self.sample = 0  # next global sample index
        self.taken = np.zeros(len(streams), dtype=np.int64)  # samples taken from each dataset so far

    @property
    def names(self) -> list[str]:
        return [lay.stream.name for lay in self.layouts]

    def _assign(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, within-dataset index) of each sample of the next global batch."""
        G = self.B * self.world
        src = self.mixture.sources(self.sample, G)  # (G,)
        k = np.empty(G, dtype=np.int64)
        for s in range(len(self.layouts)):
            sel = src == s
            k[sel] = self.taken[s] + np.arange(int(sel.sum()))
        return src, k

    def next_batch(self) -> Batch:
        src, k = self._assign()
        lo, hi = self.rank * self.B, (self.rank + 1) * self.B
        B, T = self.B, self.T
        buf = np.empty((B, T + 1), dtype=self.dtype)
        ids = np.empty((B, T), dtype=np.int32) if self.document_mask else None
        for s, lay in enumerate(self.layouts):
            rows = np.nonzero(src[lo:hi] == s)[0]
            if not rows.size:
                continue
            for row, start in zip(rows.tolist(), lay.starts(k[lo:hi][rows]).tolist()):
                lay.stream.read_marked(start, buf[row], None if ids is None else ids[row])
        tokens = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        targets = torch.empty((B, T), dtype=torch.int64, pin_memory=self.pin)
        np.copyto(tokens.numpy(), buf[:, :-1])
        np.copyto(targets.numpy(), buf[:, 1:])
        doc_ids = None
        if ids is not None:
            doc_ids = torch.from_numpy(ids)
            torch.cumsum(doc_ids, dim=1, out=doc_ids)  # document starts -> document index (numpy's is 3x slower)
            if self.pin:
                doc_ids = doc_ids.pin_memory()
        self.taken += np.bincount(src, minlength=len(self.layouts))
        self.sample += len(src)
        return tokens, targets, doc_ids

    def state_dict(self) -> dict:
        return {"sample": int(self.sample), "seq_len": self.T, "seed": self.seed, "batch_size": self.B,
                "world": self.world, "per_step": self.per_step,
                "taken": {name: int(t) for name, t in zip(self.names, self.taken)}}

    def load_state_dict(self, state: dict) -> None:
        try:
            sample, taken = int(state["sample"]), dict(state["taken"])
            seq_len, seed = int(state["seq_len"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"the saved loader position is malformed ({e!r}); it was not written by this "
                            "version of the loader") from None
        if seq_len != self.T:
            raise DataError(f"the saved loader position counts rows of {seq_len} tokens but train.seq_len is "
                            f"{self.T}; resume with train.seq_len={seq_len}, or " + FROM_THE_WEIGHTS)
        if seed != self.seed:
            raise DataError(f"the saved loader position is for train.seed={seed}, this run has {self.seed}; "
                            f"resume with train.seed={seed} to continue the same data order")
        check_resume_shape(state, self.B, self.world, self.per_step)
        if set(taken) != set(self.names):
            raise DataError(f"the saved loader position is for datasets {sorted(taken)} but this run reads "
                            f"{sorted(self.names)}; the data changed since the checkpoint. Resume with the same "
                            "data, or " + FROM_THE_WEIGHTS)
        self.sample = sample
        self.taken = np.array([int(taken[n]) for n in self.names], dtype=np.int64)


class PackedLoader:
    """Iterator of (tokens, targets, doc_ids) batches over one dataset or a weighted mixture.

    streams: one TokenStream per dataset (its `name` keys the saved position). weights: a fixed
    mixture; schedule: a curriculum instead. prefetch: batches made ahead in a background thread (0:
    made in `__next__`).
    """

    def __init__(self, streams: TokenStream | Sequence[TokenStream], seq_len: int, batch_size: int, *,
                 weights: Sequence[float] | None = None, seed: int = 0, rank: int = 0, world: int = 1,
                 document_mask: bool = True, shuffle: bool = True, prefetch: int = 2, pin_memory: bool = False,
                 per_step: int = 1, schedule: Sequence[Stage] | None = None):
        if isinstance(streams, TokenStream):
            streams = [streams]
        self.rows = PackedRows(streams, seq_len, batch_size, weights=weights, seed=seed, rank=rank, world=world,
                               document_mask=document_mask, shuffle=shuffle, pin_memory=pin_memory, per_step=per_step,
                               schedule=schedule)
        self._prefetch = Prefetcher(self.rows, prefetch) if prefetch > 0 else None
        self._start = self.rows.state_dict()
        self._state = self._start

    @classmethod
    def from_datasets(cls, datasets, split: str, seq_len: int, batch_size: int, **kwargs) -> PackedLoader:
        """A loader over the `split` of one PreparedDataset or a list of them (a mixture)."""
        if not isinstance(datasets, (list, tuple)):
            datasets = [datasets]
        streams = [TokenStream(ds.shards(split), ds.dtype, name=f"{ds.manifest['id']}/{split}",
                               vocab=ds.manifest.get("vocab_size")) for ds in datasets]
        return cls(streams, seq_len, batch_size, **kwargs)

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        if self._prefetch is None:
            batch = self.rows.next_batch()
            self._state = self.rows.state_dict()
            return batch
        batch, self._state = self._prefetch.next()
        return batch

    @property
    def epoch(self) -> float:
        """Epochs consumed of the first dataset (of the only one, without a mixture)."""
        return self._state["taken"][self.rows.names[0]] / self.rows.layouts[0].rows

    def state_dict(self) -> dict:
        """The position after the last batch returned: global sample index and samples per dataset."""
        return {**self._state, "taken": dict(self._state["taken"])}

    def load_state_dict(self, state: dict) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()
        self.rows.load_state_dict(state)
        self._state = self.rows.state_dict()

    def reset(self) -> None:
        """Back to the first batch (evaluation reads the same batches every time)."""
        self.load_state_dict(self._start)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()
