"""The chunked cross-entropy's elementwise part as one Triton kernel (`kiln.model.loss.ChunkKernel`).

`chunk_loss_and_grad` computes what `kiln.model.loss.chunk_loss_and_grad` does (the summed fp32 loss of the rows
whose target is not -100, and the gradient of that sum with respect to the logits, zero on ignored rows, in the
logits' dtype; Gemma's soft-capping included) in one launch that reads each row twice and writes it once, and can
write the gradient over the logits, which the chunked loss does not need afterwards. torch.compile's version of
the same function ran as two kernels at under half an H200's memory bandwidth (benchmarks/cross_entropy.py).

Triton is imported only when the kernel first runs: Kiln imports and trains without it (CPU builds of torch have
none). It runs on CUDA tensors, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch

from kiln.model.loss import IGNORE_INDEX

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # logits it takes (fp64 stays with PyTorch)
MAX_BLOCK_BYTES = 16384  # a block of the vocabulary per step of a row's loop: 8192 bf16 or 4096 fp32 logits


def unavailable() -> str | None:
    """Why the Triton kernel cannot run on this machine's GPU (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e}); it ships with CUDA builds of torch"
    return None


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): its kernels run on CPU tensors, slowly, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(logits: torch.Tensor) -> bool:
    """The kernel takes these logits: a plain 2-D CUDA tensor (or a CPU one under the interpreter; no subclass such
    as a DTensor) of a dtype in DTYPES."""
    return (type(logits) is torch.Tensor and logits.dim() == 2 and logits.dtype in DTYPES
            and (logits.is_cuda or interpreting()))


@functools.cache
def _program():
    from kiln.model.loss_triton_kernel import cross_entropy_rows

    return cross_entropy_rows


def launch_shape(vocab: int, dtype: torch.dtype) -> tuple[int, int]:
    """(block of the vocabulary, warps) of one row's program: a power of two up to MAX_BLOCK_BYTES of logits,
    32 of them per thread."""
    block = 1 << max(4, (vocab - 1).bit_length())
    block = min(block, MAX_BLOCK_BYTES // torch.finfo(dtype).bits * 8)
    return block, max(1, min(16, block // 1024))


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, want_grad: bool, softcap: float | None = None,
                        *, in_place: bool = False, block: int | None = None, warps: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits (n, V), targets (n,) -> (summed loss in fp32, d(sum loss)/d(logits) in the logits' dtype or None),
    as `kiln.model.loss.chunk_loss_and_grad`. in_place: the gradient is written over `logits` (and returned).
    block, warps: the launch's (see `launch_shape`; for benchmarks)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    losses = torch.empty(n, device=logits.device, dtype=torch.float32)
    grad = (logits if in_place else torch.empty_like(logits)) if want_grad else None
    if n:
        default_block, default_warps = launch_shape(vocab, logits.dtype)
        out = grad if grad is not None else logits  # not written without want_grad
        _program()[(n,)](logits, out, targets, losses, vocab, logits.stride(0), out.stride(0),
                         float(softcap or 1.0), IGNORE_INDEX, SOFTCAP=softcap is not None, WANT_GRAD=want_grad,
                         BLOCK=block or default_block, num_warps=warps or default_warps)
    return losses.sum(), grad


class TritonChunkKernel:
    """`ChunkKernel.fn` that runs the Triton kernel on the logits it takes (`runs_on`), writing the gradient over
    them (the chunked loss's own temporary), and `fallback` (PyTorch's, compiled or not) on any others. Should
    Triton fail to build one of its programs (a Triton release it was not written for), it says so once and
    `fallback` serves from then on: a run is slower, never stopped."""

    def __init__(self, fallback: Callable):
        self.fallback = fallback
        self.built: set[tuple] = set()  # the programs (dtype, gradient, soft-cap) that ran
        self.failed: str | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, want_grad: bool, softcap: float | None = None):
        if self.failed is None and runs_on(logits):
            key = (logits.dtype, want_grad, softcap is None)
            if key in self.built:
                return chunk_loss_and_grad(logits, targets, want_grad, softcap, in_place=True)
            try:  # a program's first launch builds it; the logits are untouched if that fails
                out = chunk_loss_and_grad(logits, targets, want_grad, softcap, in_place=True)
            except Exception as e:  # noqa: BLE001 (said, and PyTorch's kernel computes the same)
                self.failed = f"{type(e).__name__}: {e}"[:500]
                warnings.warn(f"the Triton cross-entropy kernel failed to build ({self.failed}); PyTorch's is used "
                              "instead (train.cross_entropy_kernel=torch chooses it without trying)", stacklevel=2)
            else:
                self.built.add(key)
                return out
        return self.fallback(logits, targets, want_grad, softcap)
