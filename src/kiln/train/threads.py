"""CPU threads of PyTorch for a run (`train.threads`) or for sampling (`kiln generate --threads`).

PyTorch starts one intra-op thread per physical core. A small model's matrix products are too
short to split: the threads spend the step keeping in step, and on a machine whose cores are shared
(the loader's prefetch thread, other processes) a thread that waits for a busy core stalls all the
others. Measured with benchmarks/threads.py (results/threads.md): on 2 cores, the quickstart model
(4M parameters) trains faster with 1 thread and samples many times faster, with identical results.
So the default (null) is 1 thread below SMALL_MODEL parameters, PyTorch's choice above it.
"""

from __future__ import annotations

import os

import torch

SMALL_MODEL = 20_000_000  # parameters: below this, one thread (see the module doc)


def cpu_threads(setting: int | None, n_params: int) -> int | None:
    """Threads for a model of `n_params` on the CPU: `setting` if given; for null, 1 for a small model
    unless OMP_NUM_THREADS chose (as torchrun does); None: keep PyTorch's default."""
    if setting is not None:
        return setting
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if n_params < SMALL_MODEL else None


def apply_threads(setting: int | None, device: torch.device, n_params: int) -> int:
    """Set PyTorch's intra-op threads for work on `device` (the CPU only: a GPU run keeps PyTorch's
    default) and return the number in force."""
    if device.type == "cpu":
        n = cpu_threads(setting, n_params)
        if n is not None:
            torch.set_num_threads(n)
    return torch.get_num_threads()
