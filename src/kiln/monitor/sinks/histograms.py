"""Histograms of the weights and of the per-parameter gradient norms every logging.histograms_every steps,
for the sinks that draw them (TensorBoard, W&B). Opt-in: each one copies every weight to the host.

The gradients are gone after the step (the trainer frees them), so their norms are read by an optimizer
step pre-hook: after clipping, before the update, on the steps that are due. Under FSDP each parameter is
sharded: rank 0's shards are what it has, and what is drawn (no collective runs on one rank only).
"""

from __future__ import annotations

from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP): this rank's shard


class ParamTap:
    """Reads the weights and the gradient norms of each parameter on every `every`-th step of `trainer`."""

    def __init__(self, every: int):
        self.every = every
        self.trainer: Any = None
        self.grad_norms: dict[str, float] = {}
        self.at = -1  # the step whose gradient norms `grad_norms` holds
        self.handle = None

    def attach(self, trainer) -> None:
        self.trainer = trainer
        self.handle = trainer.optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        step = self.trainer.step + 1  # the step being taken
        if step % self.every:
            return
        with torch.no_grad():
            self.grad_norms = {name: float(_local(p.grad).float().norm())
                               for name, p in self.trainer.model.named_parameters() if p.grad is not None}
        self.at = step

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def weights(self) -> dict[str, torch.Tensor]:
        """Each parameter's values on the host, as float32."""
        if getattr(self.trainer, "offload", None) is not None:  # kiln.parallel.offload: a step may still send weights
            self.trainer.offload.settle()
        with torch.no_grad():
            return {name: _local(p).detach().float().cpu() for name, p in self.trainer.model.named_parameters()}

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
