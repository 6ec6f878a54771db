"""What a process of a job can tell about it before importing torch: torchrun's environment variables and the
collective backend for its device, for `kiln train --nproc`, which checks them before it starts any process."""

from __future__ import annotations

import os

from kiln.errors import ConfigError


def env_int(name: str, default: int, fix: str = "leave it to torchrun") -> int:
    """An integer variable of torchrun's environment (`default` when unset); one that is not a number is a
    ConfigError that ends with `fix`."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; it is set by torchrun: "
                          f"{fix}") from None


def check_backend(backend: str, cuda: bool, device_name: str) -> None:
    """A ConfigError for dist.backend=nccl on a run that does not train on CUDA GPUs."""
    if backend == "nccl" and not cuda:
        raise ConfigError(f"dist.backend=nccl needs CUDA GPUs, and this run trains on the CPU (train.device="
                          f"{device_name}); use dist.backend=gloo (or auto) on the CPU")
