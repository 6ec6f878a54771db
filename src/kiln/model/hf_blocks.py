"""What Kiln's transformers adapters share: the library, imported lazily (the hf extra), and a model's
list of decoder blocks (where LoRA, activation checkpointing, compile and FSDP apply per block)."""

from __future__ import annotations

from torch import nn

from kiln.errors import StateError
from kiln.versions import require


def transformers_module():
    """The transformers library, imported on first use (an extra: kiln[hf]) and of a version Kiln is tested
    with (kiln.versions), with its download bars off."""
    transformers = require("transformers", "model.hf_class=auto")
    transformers.utils.logging.disable_progress_bar()  # its per-file bars would break Kiln's console output
    return transformers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a transformers model: the ModuleList whose blocks are of a class the
    model names in `_no_split_modules`, else the ModuleList that holds the most parameters."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for m in lists:
        if type(m[0]).__name__ in names:
            return m
    if not lists:
        raise StateError(f"{type(base).__name__} has no list of blocks (nn.ModuleList) to checkpoint, compile "
                         "or shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
