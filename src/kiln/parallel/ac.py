"""Activation checkpointing of the model's blocks: none, selective or full.

- full: each block keeps only its input; everything inside is recomputed in the backward pass.
- selective: each block keeps the outputs of its matrix products and of attention (the expensive
  ops) and recomputes the cheap elementwise ones (norms, rotary, SiLU, casts), which hold a large
  share of the activation memory and cost little to redo.

The block's `forward` is wrapped in place, so module names and state-dict keys do not change.
Apply before `kiln.parallel.compile.apply_compile`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kiln.model import grouped_mm
from kiln.parallel import experts
from kiln.streams import drop_log_lines

MODES = ("none", "selective", "full")

_aten = torch.ops.aten
_SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_mm.default,  # float8 linear layers (train.fp8)
    *([_aten._grouped_mm.default] if hasattr(_aten, "_grouped_mm") else []),  # a mixture of experts' (kiln.model.moe)
    grouped_mm.ROWS_OP,  # the same products as a loop over the experts' rows, off Hopper or bf16
    experts.DISPATCH_OP,  # expert parallelism's all-to-alls and experts (kiln.parallel.experts): not redone
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_policy(ops: frozenset):
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _checkpointed(forward, mode: str, preserve_rng: bool = False, keep: frozenset = frozenset()):
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    elif keep:  # full, but these ops' outputs kept: everything else is recomputed
        context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_policy(keep))

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn else {}
        # a block draws random numbers only with dropout (LoRA's): then the recomputation replays its RNG state
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng, **extra, **kwargs)

    return wrapped


def apply_ac(model: nn.Module, mode: str, keep: frozenset = frozenset()) -> nn.Module:
    """Checkpoint every block of `model.layers` in `mode` (none, selective, full). Returns the model. `keep`: ops
    whose outputs full checkpointing keeps rather than recomputes (expert parallelism's dispatch, whose
    recomputation would repeat its all-to-alls)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode '{mode}' is not one of {', '.join(MODES)}")
    if mode == "none":
        return model
    if mode == "selective" or keep:  # torch.compile warns that the policy's regions must hold no in-place ops, on
        # every rank: the blocks' regions hold none (tests/unit/parallel/test_ac_compile.py checks the compiled
        # gradients)
        drop_log_lines("torch._higher_order_ops.wrap", "context_fn is passed to torch.utils.checkpoint")
    for block in model.layers:
        if getattr(block, "_kiln_ac", None):
            raise RuntimeError("activation checkpointing is already applied to this model")
        dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules())
        block.forward = _checkpointed(block.forward, mode, preserve_rng=dropout, keep=keep)
        block._kiln_ac = mode
    return model
