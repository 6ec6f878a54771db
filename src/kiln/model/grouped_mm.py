"""The grouped products of a mixture of experts: rows sorted by group, each group's rows times its own weight.

    out[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g].T        x (N, K), w (G, M, K), offs (G,) int32 ends

`grouped_mm` runs torch's grouped GEMM (`torch._grouped_mm`: one kernel for every group, no host sync) where it
serves the operands: a CUDA GPU of compute capability 9 or more (Hopper), bf16 operands, rows of 16 bytes.
Anywhere else it runs `grouped_mm_loop`: one product per group over that group's rows, so each row is
multiplied by its own group's weight only, the kernel's work, for one host read of the group ends per call.

The loop is a custom operator (`kiln::grouped_rows`, with its gradient `kiln::grouped_rows_weight_grad`) that
torch's compiler treats as one opaque call: a block compiled whole (fullgraph) keeps it, and it still does
each row's product once. A loop of static shapes traced into the graph instead would multiply every row by
every group's weight and keep one, G times the work (128 times for Qwen3-30B-A3B's experts).

On a CUDA device the loop is the kernel's work without its speed, so it says so: the first call for each
reason warns (`ExpertsKernelWarning`) with what kept the kernel out (`kernel_refusal`).
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["ExpertsKernelWarning", "grouped_mm", "grouped_mm_loop", "hopper_or_newer", "kernel_refusal"]


class ExpertsKernelWarning(UserWarning):
    """A mixture of experts on a CUDA device runs its products as a loop over the experts (slower), not as
    torch's grouped GEMM."""


def hopper_or_newer(index: int) -> bool:
    """Whether CUDA device `index` is a Hopper (sm90) or newer GPU, where torch's grouped GEMM kernel runs. Both
    calls are ones torch's compiler folds into constants when it traces a graph: no graph break."""
    return torch.cuda.is_available() and torch.cuda.get_device_properties(index).major >= 9


def kernel_refusal(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why torch's grouped GEMM cannot multiply x (N, K) by w (G, M, K), or None where it can. Asked while a
    graph is traced too: every test is one torch's compiler answers with a constant."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if not x.is_cuda:
        return f"the operands are on the {x.device.type}, and the kernel is CUDA's"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return (f"the operands are {x.dtype} and {w.dtype}, and the kernel takes bf16 only (train.precision=bf16, "
                "or autocast to bf16)")
    if not hopper_or_newer(x.device.index or 0):
        return "the GPU is older than Hopper (compute capability 9.0), where the kernel starts"
    if x.shape[-1] % 8 or w.shape[1] % 8:
        return (f"rows of {x.shape[-1]} and {w.shape[1]} elements are not multiples of 16 bytes (8 bf16 "
                "elements), as the kernel needs")
    return None


def _grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM serves these operands (`kernel_refusal` has no objection)."""
    return kernel_refusal(x, w) is None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (N, K), its rows sorted by group; w (G, M, K), each group's weight laid out as nn.Linear's; offs (G,)
    int32, the end row of each group. Returns (N, M): each row times its group's weight, transposed (rows past
    the last end are zero on the loop, and left unwritten by the kernel)."""
    if _grouped_kernel(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return grouped_mm_loop(x, w, offs)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as one product per group over its own rows (the CPU, fp32, GPUs older than Hopper): the
    kernel's products and work, eager or compiled, for one host read of the group ends."""
    return torch.ops.kiln.grouped_rows(x, w, offs)


_warned: set[str] = set()


def warn_once(why: str) -> bool:
    """Warn that the experts' products run as a loop on a GPU, and why; once per reason and process. Returns
    whether it warned."""
    if why in _warned:
        return False
    _warned.add(why)
    warnings.warn(f"the mixture of experts multiplies each expert's rows in a loop over the experts, not with "
                  f"torch's grouped GEMM, because {why}: the same work, but slower", ExpertsKernelWarning,
                  stacklevel=3)
    return True


def _ranges(offs: torch.Tensor):
    """(group, first row, end row) of each group with rows: one host read of the ends."""
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            yield g, start, end
        start = max(start, end)


_TAGS = {"tags": (torch.Tag.cudagraph_unsafe,)} if (
    hasattr(torch.Tag, "cudagraph_unsafe") and "tags" in inspect.signature(torch.library.custom_op).parameters) else {}


@torch.library.custom_op("kiln::grouped_rows", mutates_args=(), **_TAGS)
def _grouped_rows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        why = kernel_refusal(x, w)
        if why is not None:
            warn_once(why)
    out = x.new_empty(x.shape[0], w.shape[1])
    last = 0
    for g, start, end in _ranges(offs):
        torch.mm(x[start:end], w[g].t(), out=out[start:end])
        last = end
    out[last:].zero_()
    return out


@_grouped_rows.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("kiln::grouped_rows_weight_grad", mutates_args=(), **_TAGS)
def _weight_grad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The gradient of each group's weight (G, M, K): its rows of `grad` (N, M), transposed, times its rows of x
    (N, K); zero for a group without rows."""
    out = grad.new_zeros(offs.shape[0], grad.shape[1], x.shape[1])
    for g, start, end in _ranges(offs):
        torch.mm(grad[start:end].t(), x[start:end], out=out[g])
    return out


@_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offs.shape[0], grad.shape[1], x.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad: torch.Tensor):
    x, w, offs = ctx.saved_tensors
    gx = _grouped_rows(grad, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    gw = _weight_grad(grad, x, offs) if ctx.needs_input_grad[1] else None
    return gx, gw, None


_grouped_rows.register_autograd(_backward, setup_context=_setup)
ROWS_OP = torch.ops.kiln.grouped_rows.default  # the loop's operator, as a graph or a checkpoint policy sees it


@register_flop_formula(torch.ops.kiln.grouped_rows)
def _rows_flops(x_shape, w_shape, offs_shape, *args, **kwargs) -> int:
    """Each row times one group's weight: what a profile with FLOPs (and a test) counts for the loop."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[1]


@register_flop_formula(torch.ops.kiln.grouped_rows_weight_grad)
def _weight_grad_flops(grad_shape, x_shape, offs_shape, *args, **kwargs) -> int:
    return 2 * grad_shape[0] * grad_shape[1] * x_shape[1]
