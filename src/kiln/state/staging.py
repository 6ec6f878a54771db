"""Copies of the state that training may not change: CPU staging buffers and detached JSON parts.

Staging uses `torch.distributed.checkpoint.staging.DefaultStager`, synchronous (the loop waits for the
copy, then goes on while the copy is written), with pinned buffers and non-blocking copies on CUDA.
Its buffers are kept per source tensor and reused by every later save, as Kiln's own staging did
(0.26 s at 1B on an H100: the device-to-host copy at PCIe speed). What DCP's stager cannot do is
allocate its pinned buffers without a copy; `warm_up` therefore stages once, from a side stream in
a background thread right after the first step, so that the first checkpoint only copies. That
copy is thrown away (the state changes under it), and it does not hold up training kernels.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def make_stager(log: Callable[[str], None], pin: bool | None = None) -> DefaultStager:
    """A synchronous DCP stager: pinned memory and non-blocking copies where CUDA is in use."""
    cuda = on_cuda() if pin is None else pin
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


def stage(stager: DefaultStager, tensors: dict[str, Any], log: Callable[[str], None]) -> tuple[DefaultStager, Any]:
    """Stage `tensors` (returns the stager used: a plain-memory one if pinning fails) and the CPU copy."""
    try:
        return stager, stager.stage(tensors)
    except RuntimeError as e:  # pinned (page-locked) memory is scarcer than plain memory
        if not on_cuda():
            raise
        log(f"could not pin CPU memory for checkpoint staging ({e}); using plain memory (slower)")
        stager.close()
        plain = DefaultStager(StagingOptions(False, False, False, False))
        return plain, plain.stage(tensors)


def warm_up(stager: DefaultStager, tensors: dict[str, Any]) -> None:
    """Allocate the stager's buffers (a throwaway copy, made from a side stream off the training stream)."""
    if on_cuda():
        with torch.cuda.stream(torch.cuda.Stream()):
            stager.stage(tensors)
    else:
        stager.stage(tensors)


def clone_tree(obj: Any) -> Any:
    """A copy of nested dicts/lists whose tensors are cloned (other leaves are shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in nested dicts/lists (a DTensor counts its global size: what DCP writes in all)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    raise TypeError(f"{type(obj).__name__} in a state_dict() is not JSON data; return plain numbers and lists")


def json_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A detached, JSON-safe copy of small parts' state dicts."""
    return json.loads(json.dumps(state, default=_json_default))
