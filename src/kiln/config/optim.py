"""`optim:` the optimizer's hyperparameters (the learning rate and its schedule are in `train:`)."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import Section


class OptimConfig(Section):
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay, applied to matrices only (not norms, biases or embeddings)."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    fused: bool | None = None
    """Use the fused AdamW kernel; null: on CUDA only, and on the host with train.offload (torch's fused CPU
    kernel: vectorised, multi-threaded)."""
