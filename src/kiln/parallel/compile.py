"""torch.compile applied to the model from outside, keeping module names and state-dict keys.

Each transformer block is compiled on its own (`nn.Module.compile`, in place): the blocks share
one code object, so one compiled graph serves them all, compile time does not grow with depth,
and activation checkpointing wraps cleanly inside. The chunked cross-entropy's elementwise kernel
is compiled too, so the softmax, the loss and the logits' gradient are one fused pass per chunk.
That kernel is process-wide (every model's loss uses it): `restore_loss_kernel` puts the plain one back.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.model import loss as loss_module
from kiln.model import masks


def apply_compile(model: nn.Module, loss: bool = True, scope: str = "blocks", mode: str | None = None) -> nn.Module:
    """Compile in place, each block of `model.layers` and the final norm (scope 'blocks') or the
    whole forward pass up to the loss (scope 'model'); and the loss kernel. Returns the model.
    `mode` is torch.compile's (None: the default; 'reduce-overhead': CUDA graphs)."""
    if scope == "model":
        eager_parts()
        model.compile(mode=mode)
    else:
        full = getattr(model, "fullgraph", True)  # False for transformers' blocks (kiln.model.hf_auto)
        room_for_kinds(model.layers)
        for block in model.layers:
            block.compile(fullgraph=full, mode=mode)
        if getattr(model, "norm", None) is not None:
            model.norm.compile(fullgraph=full, mode=mode)
    if loss:
        compile_loss_kernel()
    return model


MODES_PER_KIND = 4  # training, evaluation, a no-grad forward in training mode (the spike check), one spare


def room_for_kinds(blocks) -> int:
    """Let each compiled block code hold a graph per kind of block and mode. Blocks of one class share their
    forward's code, and torch keeps at most `recompile_limit` (8) graphs per code: a hybrid model's Mamba,
    attention and MLP blocks in training and evaluation passed it, and the blocks past it failed (fullgraph)
    or ran eagerly. Returns the number of kinds (blocks that differ in their submodules' types)."""
    import torch._dynamo.config as dynamo

    kinds = len({tuple(type(m).__name__ for m in b.modules()) for b in blocks})
    dynamo.recompile_limit = max(dynamo.recompile_limit, MODES_PER_KIND * kinds)
    return kinds


def eager_parts() -> None:
    """A model compiled whole calls its mask builder and its chunked cross-entropy outside its graph
    (torch.compiler.disable), for every model of this process: the mask is built once per batch and goes in
    as an input, and the loss is a loop of large kernels around the compiled kernel, with nothing to fuse.
    Applied here, not where they are defined: the decorator imports torch's compiler, 2 s at every start of
    a process that never compiles."""
    for module, name in ((masks, "doc_mask"), (loss_module, "linear_cross_entropy")):
        fn = getattr(module, name)
        if not getattr(fn, "_torchdynamo_disable", False):
            setattr(module, name, torch.compiler.disable(fn))


def compile_loss_kernel() -> None:
    """Compile the chunked cross-entropy's elementwise kernel, for every model of this process: the
    softmax, the loss and the logits' gradient become one fused pass over each chunk."""
    kernel = loss_module.ChunkKernel
    if kernel.fn is loss_module.chunk_loss_and_grad:
        kernel.fn = torch.compile(loss_module.chunk_loss_and_grad, fullgraph=True)
    elif getattr(kernel.fn, "fallback", None) is loss_module.chunk_loss_and_grad:  # behind the Triton kernel
        kernel.fn.fallback = torch.compile(loss_module.chunk_loss_and_grad, fullgraph=True)


def restore_loss_kernel() -> None:
    """Undo the process-wide part of `apply_compile`: the loss of every model uses the plain (eager)
    kernel again. Models already compiled keep their compiled blocks."""
    loss_module.ChunkKernel.fn = staticmethod(loss_module.chunk_loss_and_grad)


def compiled_graph_count() -> int:
    """Graphs compiled so far in this process (for checking that nothing recompiles after warm-up)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
