"""The load-balancing loss of a transformers mixture-of-experts model (model.hf_class=auto).

A model whose config.json sets `output_router_logits` (Mixtral, Qwen2-MoE, OLMoE, ...) returns an
auxiliary loss that keeps its router spreading tokens over the experts; the Hugging Face Trainer trains
on cross-entropy + `router_aux_loss_coef` x that loss, as the model's own forward adds it when given labels.
Kiln computes the cross-entropy itself, so `HFCausalLM` adds the term the same way (`router_aux_coef`) in
training and keeps the unscaled loss of each forward (`RouterAux`), which kiln.train.router_aux logs as
`aux_loss` beside `loss` (the sum that trains) at every logging step. Evaluation reports the cross-entropy
alone: val_loss, perplexity and bits per byte compare with other models.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def router_aux_coef(config: Any, takes_flag: bool) -> float | None:
    """The weight of the load-balancing loss in training, or None where the model adds none (its config
    leaves output_router_logits off, or its forward has no such flag)."""
    if not takes_flag or not getattr(config, "output_router_logits", False):
        return None
    coef = getattr(config, "router_aux_loss_coef", None)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool):
        log.warning("%s sets output_router_logits but names no router_aux_loss_coef: it trains without its "
                    "load-balancing loss", type(config).__name__)
        return None
    return float(coef)


class RouterAux:
    """The unscaled load-balancing losses of the training forwards since the last read, summed on the device."""

    def __init__(self):
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, aux: torch.Tensor) -> None:
        aux = aux.detach().float()
        self.total = aux if self.total is None else self.total + aux
        self.count += 1

    def take(self) -> torch.Tensor | None:
        """Their mean (a 0-d tensor), and a fresh start; None when no forward added one."""
        if self.total is None:
            return None
        mean = self.total / self.count
        self.total, self.count = None, 0
        return mean
