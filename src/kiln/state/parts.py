"""The parts of a run's state, each a `Stateful` (`state_dict()` / `load_state_dict()`), under fixed keys.

    model      the model's trainable parameters and its buffers (DCP; DTensor shards under FSDP2); frozen
               parameters (a LoRA run's base) are left out: they come from model.init_from, known by hash
    optim      the optimizer's moments (DCP); its hyperparameters come from the config on load
    scheduler  the learning-rate schedule's position (JSON); its peak rate comes from the config on load
    loader     the training loader's position (JSON)
    trainer    the trainer's own counters: step, tokens seen, last evaluation (JSON)
    rng        every random generator of this process (JSON, one file per process)

`trainer_parts(trainer)` builds them for a `Trainer`; the checkpointer and the memory snapshots save and
load whatever dict of parts they are given, through public torch APIs only.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kiln.state.rng import rng_state, set_rng_state

TENSOR_KEYS = ("model", "optim")  # written by DCP, sharded per process
SMALL_KEYS = ("scheduler", "loader", "trainer")  # JSON, written once by rank 0 (state.json)
RANK_KEYS = ("rng",)  # JSON, one file per process (rank<R>.json)
KEYS = TENSOR_KEYS + SMALL_KEYS + RANK_KEYS


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile keeps the module it compiled here


class ModelState:
    """The model's weights without its frozen parameters: with LoRA, the adapters alone. Loading sets
    those and leaves the frozen base as it is (the caller loaded it from model.init_from)."""

    def __init__(self, model: nn.Module):
        self.model = _unwrap(model)
        inner = getattr(self.model, "module", self.model)  # DDP's keys are those of the module inside
        # every name of a frozen parameter: a tied one has two (embed_tokens.weight and lm_head.weight)
        self.frozen = {n for n, p in inner.named_parameters(remove_duplicate=False) if not p.requires_grad}
        self.options = StateDictOptions(ignore_frozen_params=bool(self.frozen), strict=not self.frozen)

    def state_dict(self) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = get_model_state_dict(self.model, options=self.options)
        return {k: v for k, v in state.items() if k not in self.frozen} if self.frozen else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_model_state_dict(self.model, state, options=self.options)


class OptimizerState:
    """The optimizer's moments. Reading it creates them when they do not exist yet, so the checkpointer
    saves nothing before the first step. On load, the config's hyperparameters (lr, betas, weight
    decay, ...) stay: a forced resume may change them; the checkpoint brings the moments."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = _unwrap(model), optimizer

    def state_dict(self) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, h in zip(self.optimizer.param_groups, hyper):
            group.update(h)


class SchedulerState:
    """A `LambdaLR`'s position. On load the schedule's peak rates (base_lrs) and function stay those of
    the config, and the optimizer's rates are set to what the schedule gives at the saved position."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.scheduler
        epoch = state["last_epoch"]
        lrs = [base * fn(epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        s.load_state_dict({**state, "base_lrs": list(s.base_lrs), "_last_lr": lrs,
                           "lr_lambdas": [None] * len(s.lr_lambdas)})
        for group, lr in zip(s.optimizer.param_groups, lrs):
            group["lr"] = lr


class RNGState:
    """Python, NumPy, torch CPU and CUDA generators of this process."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


def model_part(trainer) -> Stateful:
    """The "model" part of a `Trainer`: its weights, or an offloaded optimizer's fp32 masters."""
    offload = getattr(trainer, "offload", None)
    return offload.parts()["model"] if offload is not None else ModelState(trainer.model)


def trainer_parts(trainer) -> dict[str, Stateful]:
    """The state of a `Trainer`, under the fixed keys (an offloaded optimizer's model and optim parts are its own:
    kiln.parallel.offload)."""
    offload = getattr(trainer, "offload", None)
    return {
        "model": ModelState(trainer.model),
        "optim": OptimizerState(trainer.model, trainer.optimizer),
        "scheduler": SchedulerState(trainer.scheduler),
        "loader": trainer.train_loader,
        "trainer": trainer,
        "rng": RNGState(),
        **(offload.parts() if offload is not None else {}),
    }


def as_parts(state) -> dict[str, Stateful]:
    """`state` as a dict of parts: a `Trainer` is taken apart, a dict is checked for the fixed keys."""
    parts = dict(state) if isinstance(state, dict) else trainer_parts(state)
    missing = [k for k in KEYS if k not in parts]
    unknown = [k for k in parts if k not in KEYS]
    if missing or unknown:
        raise ValueError(f"checkpoint parts must have the keys {KEYS}; missing {missing}, unknown {unknown}")
    return parts
