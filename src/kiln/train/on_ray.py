"""`kiln launch ray CONFIG --workers N`: `kiln train` on a Ray cluster, through Ray Train's TorchTrainer.

Ray starts N workers (each with its GPUs, or CPUs), sets up their torch.distributed process group
(NCCL on GPUs, gloo on CPUs) and the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, ...), and each
worker runs Kiln's training as a process of `kiln train --nproc` does: the same mesh (Kiln joins the
group Ray made), the same loader slices, the same checkpoints. So the run is the same run, and
resumes exactly, whether torchrun or Ray started it. The run directory and the data cache must be on
storage every node sees; the workers resume from its newest checkpoint when Ray restarts them after a
failure (`max_failures`). For users whose clusters are Ray (KubeRay): `address` joins one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.config import load_config
from kiln.errors import ConfigError


def train_worker(params: dict[str, Any]) -> None:
    """Ray Train's loop on each worker: `kiln train` of the resolved config."""
    import os

    from rich.console import Console

    from kiln.train.run import run

    if os.path.isdir(params["cwd"]):  # the config's relative paths are the caller's (on another node: its own folder)
        os.chdir(params["cwd"])
    cfg = load_config(params["config"], params["overrides"])
    run(cfg, Console(), resume=params["resume"])


def launch(config: str | None, overrides: Sequence[str], workers: int, *, gpus_per_worker: float = 0,
           cpus_per_worker: float = 1, address: str | None = None, max_failures: int = 0, resume: str = "auto",
           log: Callable[[str], None] = print) -> Path:
    """Run the training on `workers` Ray workers; returns the run directory."""
    import os

    if workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1")
    cfg = load_config(config, list(overrides))  # a bad config fails here, before Ray starts
    device = cfg.train.device
    if gpus_per_worker and device == "cpu":
        raise ConfigError("--gpus-per-worker with train.device=cpu: the workers would hold GPUs and not use them")
    if not gpus_per_worker and device.startswith("cuda"):
        raise ConfigError(f"train.device={device} and no --gpus-per-worker: give each worker its GPU(s)")
    run_dir = Path(cfg.train.run_dir or f"runs/ray-{Path(config).stem if config else 'quickstart'}").expanduser()
    run_dir = run_dir.absolute()
    overrides = [*overrides, f"train.run_dir={run_dir}"]
    if not gpus_per_worker and device == "auto":
        overrides.append("train.device=cpu")  # the workers hold no GPU: do not reach for one
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise ConfigError("kiln launch ray needs Ray Train: pip install 'ray[train]'") from None
    if config is not None and Path(config).expanduser().is_file():
        config = str(Path(config).expanduser().absolute())
    started = not ray.is_initialized()
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, configure_logging=False)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if gpus_per_worker else "gloo")
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"config": config, "overrides": overrides, "cwd": os.getcwd(), "resume": resume},
        torch_config=TorchConfig(backend=backend, timeout_s=cfg.dist.timeout_s),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(gpus_per_worker),
                                     resources_per_worker={"CPU": cpus_per_worker,
                                                           **({"GPU": gpus_per_worker} if gpus_per_worker else {})}),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir.parent / ".ray"),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    log(f"ray: {workers} worker(s) x {gpus_per_worker or cpus_per_worker} {'GPU' if gpus_per_worker else 'CPU'}, "
        f"{backend}; run directory {run_dir}")
    try:
        result = trainer.fit()
    finally:
        if started:
            ray.shutdown()
    if result.error is not None:
        raise result.error
    return run_dir
