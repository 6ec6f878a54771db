"""The CUDA caching allocator's settings for a run: expandable segments, unless the user chose otherwise.

PyTorch's allocator keeps freed blocks in fixed segments; a run whose tensors change size (FSDP's gathered
parameters, the chunked loss, a Mamba scan's chunks) can end with gigabytes reserved but unusable, and an
allocation that fails although the card has room ("reserved but unallocated" in the out-of-memory message).
Expandable segments grow one mapping per stream instead, so freed memory is reused whatever its size. Kiln turns
them on for its runs; a PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) set in the environment is the user's
choice and left alone, `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False` included.
"""

from __future__ import annotations

import os

import torch

SETTING = "expandable_segments:True"
USER = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def configure() -> str | None:
    """Turn on expandable segments for this process (and the processes it starts) unless the environment names an
    allocator setting. Returns the setting applied (None: the user's stays)."""
    if any(os.environ.get(name) for name in USER):
        return None
    os.environ[USER[0]] = SETTING  # read when CUDA starts in this process, and inherited by its children
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # started already (a benchmark, a notebook)
        torch.cuda.memory._set_allocator_settings(SETTING)  # segments made from now on
    return SETTING
