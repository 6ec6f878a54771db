"""AdamW with parameter groups, and learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.config import OptimConfig, TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices of linear layers only; none on norms, biases and embeddings."""
    decay, no_decay, seen = [], [], set()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, ocfg: OptimConfig, lr: float, device: torch.device) -> torch.optim.Optimizer:
    fused = ocfg.fused if ocfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, ocfg.weight_decay), lr=lr, betas=(ocfg.beta1, ocfg.beta2),
                             eps=ocfg.eps, fused=fused)


def offload_optimizer(model: nn.Module, ocfg: OptimConfig, lr: float):
    """AdamW on the host over the fp32 masters of a model placed for offload (kiln.parallel.offload); optim.fused
    null takes torch's fused CPU kernel (vectorised, multi-threaded)."""
    from kiln.parallel.offload import OptimizerOffload

    return OptimizerOffload(model, param_groups(model, ocfg.weight_decay), lr, (ocfg.beta1, ocfg.beta2), ocfg.eps,
                            ocfg.fused)


def lr_factor(step: int, tcfg: TrainConfig) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    total, warm, floor = tcfg.max_steps, tcfg.warmup_steps, tcfg.min_lr_ratio
    if warm and step < warm:
        return (step + 1) / warm
    if tcfg.schedule == "constant":
        return 1.0
    if tcfg.schedule == "wsd":
        decay_steps = max(1, int(total * tcfg.decay_fraction))
        decay_start = total - decay_steps
        if step < decay_start:
            return 1.0
        return 1.0 - (1.0 - floor) * min(1.0, (step - decay_start + 1) / decay_steps)
    progress = min(1.0, (step - warm + 1) / max(1, total - warm))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_warning(tcfg: TrainConfig) -> str | None:
    """What is wrong with a schedule that is valid but cannot be meant: a warmup as long as the run or longer, whose
    learning rate never reaches train.lr and never decays."""
    if tcfg.warmup_steps < tcfg.max_steps:
        return None
    top = lr_factor(tcfg.max_steps - 1, tcfg)
    return (f"train.warmup_steps={tcfg.warmup_steps} is not shorter than train.max_steps={tcfg.max_steps}: the "
            f"learning rate only rises, to {top:.0%} of train.lr at the last step, and never decays; lower "
            "train.warmup_steps")


def build_scheduler(opt: torch.optim.Optimizer, tcfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, tcfg))
