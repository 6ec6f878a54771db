"""Which kernel computes the chunked cross-entropy's elementwise part (`train.cross_entropy_kernel`).

'triton' installs `kiln.model.loss_triton`'s kernel as `kiln.model.loss.ChunkKernel.fn` (process-wide, as
`kiln.parallel.compile` does for PyTorch's) with PyTorch's kernel, compiled or not, behind it for logits it does
not take (CPU, fp64); 'torch' keeps PyTorch's; 'auto' is 'triton' where it can run (a CUDA device and triton
importable), else 'torch'. Asking for 'triton' where it cannot run is a ConfigError before training starts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.errors import ConfigError
from kiln.model import loss as loss_module


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernel cannot serve a run on `device` (None: it can)."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs, and this run's device is {device}"
    from kiln.model.loss_triton import unavailable

    return unavailable()


def choose(choice: str, device: torch.device) -> str:
    """'triton' or 'torch' for `choice` (train.cross_entropy_kernel) on `device`; ConfigError if 'triton' was
    asked for and cannot run."""
    if choice == "torch":
        return "torch"
    why = triton_problem(device)
    if why is None:
        return "triton"
    if choice == "triton":
        raise ConfigError(f"train.cross_entropy_kernel=triton cannot be used: {why}; set "
                          "train.cross_entropy_kernel=auto (Triton where it can run) or torch")
    return "torch"


def install(choice: str, device: torch.device, log: Callable[[str], None] = print) -> str:
    """Make `choose(choice, device)`'s kernel the one every chunked loss of this process uses; returns its name.
    Call after `kiln.parallel.compile.apply_compile`, which may have compiled PyTorch's."""
    from kiln.model.loss_triton import TritonChunkKernel

    kind = choose(choice, device)
    current = loss_module.ChunkKernel.fn
    torch_kernel = current.fallback if isinstance(current, TritonChunkKernel) else current
    if kind == "triton":
        loss_module.ChunkKernel.fn = TritonChunkKernel(torch_kernel)
    else:
        loss_module.ChunkKernel.fn = staticmethod(torch_kernel)
        if choice == "auto" and device.type == "cuda":
            log(f"train.cross_entropy_kernel auto: torch ({triton_problem(device)})")
    return kind
