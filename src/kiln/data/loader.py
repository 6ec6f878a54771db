"""PackedLoader: fixed-length rows from a prepared token file, in a seeded, resumable order.

Sample i of an epoch is the window tokens[j*T : j*T + T + 1] with j = perm(seed, epoch)[i]; rank r
of w takes samples r*B .. r*B+B-1 of each global batch of w*B. The position is the state.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.data.prepare import PreparedDataset
from kiln.errors import DataError


class PackedLoader:
    def __init__(self, ds: PreparedDataset, split: str, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world: int = 1):
        self.tokens = np.memmap(ds.split_path(split), dtype=ds.dtype, mode="r")
        self.T, self.B, self.seed, self.rank, self.world = seq_len, batch_size, seed, rank, world
        self.n_samples = (len(self.tokens) - 1) // seq_len
        if self.n_samples < batch_size * world:
            raise DataError(f"the '{split}' split of {ds.path} has {len(self.tokens)} tokens, fewer than one "
                            f"global batch of {batch_size * world} x {seq_len + 1}; use more data or a smaller "
                            "batch or sequence")
        self.per_epoch = self.n_samples // (batch_size * world)  # global batches per epoch
        self.epoch, self.batch_index = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0)

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_samples)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_index >= self.per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        start = (self.batch_index * self.world + self.rank) * self.B
        rows = self._order()[start : start + self.B]
        self.batch_index += 1
        T = self.T
        buf = np.stack([self.tokens[j * T : j * T + T + 1] for j in rows]).astype(np.int64)  # (B, T+1)
        t = torch.from_numpy(buf)
        return t[:, :-1], t[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
