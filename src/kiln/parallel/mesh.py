"""The process group of a run: who this process is, which device it drives, and the device mesh.

torchrun (or `kiln train --nproc N`, or a Kubernetes/Slurm launch file) starts one process per
device and sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
`init_mesh` reads them, joins the process group (NCCL on GPUs, gloo on CPUs), pins the device
(`cuda:LOCAL_RANK`) and builds the device mesh the strategies shard over:

    1-D  (world,)               dim "dp": DDP, FSDP full / grad_op
    2-D  (replicas, shards)     dims "replicate", "shard": FSDP hybrid (HSDP), shard inside a node

A process started without torchrun is the one-process run of today: no process group, no mesh.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kiln.config import DistConfig, dotted
from kiln.errors import ConfigError, ResourceError
from kiln.parallel import allocator
from kiln.parallel.env import check_backend, env_int


@dataclass
class Mesh:
    """This process's place in the run. `mesh` is None in a one-process run."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    local_world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh
    owns_group: bool = False  # this object initialised the process group, so close() destroys it

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def nodes(self) -> int:
        return max(1, self.world // max(1, self.local_world))

    def hybrid_mesh(self, replicas: int | None) -> object:
        """A 2-D (replicate, shard) mesh for HSDP: `replicas` groups (default: one per node), each
        sharding the model over world / replicas processes."""
        from torch.distributed.device_mesh import init_device_mesh

        r = replicas or self.nodes
        if r < 1 or self.world % r:
            raise ConfigError(f"dist.replicas={r} does not divide the {self.world} processes of this run; choose a "
                              f"divisor of {self.world} (one replica per node is {self.nodes})")
        return init_device_mesh(self.device.type, (r, self.world // r), mesh_dim_names=("replicate", "shard"))

    def describe(self, strategy: str, cfg: DistConfig) -> str:
        """How the model is spread over this run's processes (`strategy`: parallelize.strategy_of's answer)."""
        if strategy != "fsdp":
            return strategy
        if cfg.sharding == "hybrid":
            r = cfg.replicas or self.nodes
            text = f"fsdp hybrid, {r} replica(s) x {self.world // r} shards"
        else:
            text = f"fsdp {cfg.sharding} ({'ZeRO-3' if cfg.sharding == 'full' else 'ZeRO-2'})"
        return text + (", cpu_offload" if cfg.cpu_offload else "")

    def close(self, clean: bool = False) -> None:
        """Leave the process group (if this object joined it). `clean` (every rank got here without an
        error): wait for all ranks first, so none tears down its group while a peer still uses it."""
        if self.owns_group and dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what joining a process group needs


def process_env() -> tuple[int, int, int, int]:
    """(world, rank, local_rank, local_world) from torchrun's environment, checked: a process started with part
    of it (RANK left over in a shell, WORLD_SIZE without the rest) is a ConfigError, not a run that trains
    alone believing it is not rank 0 (and so writes no run files), nor torch's traceback."""
    world = env_int("WORLD_SIZE", 1)
    rank, local_rank = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    fix = ("start the processes with torchrun or `kiln train --nproc N` (they set them all), or unset them for a "
           "one-process run")
    if world > 1:
        missing = [v for v in LAUNCH_VARS if not os.environ.get(v)]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world} is set in the environment but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not; {fix}")
    elif world < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={world}: it must be 1 or more; {fix}")
    elif rank:
        raise ConfigError(f"environment variable RANK={rank} is set but WORLD_SIZE is "
                          f"{'not' if not os.environ.get('WORLD_SIZE') else world}: a one-process run is rank 0; "
                          f"{fix}")
    if not 0 <= rank < world:
        raise ConfigError(f"environment variable RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world}); {fix}")
    return world, rank, local_rank, local_world


def rank_device(name: str, local_rank: int) -> torch.device:
    """The device of process `local_rank` on its node for train.device `name`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device: '{name}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ResourceError(f"train.device={name} but CUDA is not available here; use train.device=cpu")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        if dev.index >= torch.cuda.device_count():
            raise ResourceError(f"process {local_rank} of this node needs GPU {dev.index}, but only "
                                f"{torch.cuda.device_count()} are visible; start at most that many processes "
                                "per node (--nproc / --nproc_per_node)")
    return dev


def init_mesh(device_name: str, cfg: DistConfig, log: Callable[[str], None] = print) -> Mesh:
    """Join the process group torchrun describes (if any) and pick this process's device."""
    world, rank, local_rank, local_world = process_env()
    allocator.configure()  # before this process first allocates on a GPU
    device = rank_device(device_name, local_rank if world > 1 else 0)
    if world <= 1:
        n = torch.cuda.device_count() if device.type == "cuda" else 0
        if n > 1:
            log(f"this machine has {n} GPUs and this run uses one. Use them all with `kiln train CONFIG --nproc {n}` "
                f"(or `torchrun --nproc_per_node {n} -m kiln.cli train CONFIG`)")
        return Mesh(device=device)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: stop (with a checkpoint) if it is killed
        from kiln.parallel.launch.torchrun import missing_env, stop_with_parent

        stop_with_parent()
        advice = missing_env()
        if advice and rank == 0:
            log(advice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    check_backend(backend, device.type == "cuda", device_name)
    owns = not dist.is_initialized()
    if owns:
        join_group(backend, device, cfg.timeout_s)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return Mesh(rank, local_rank, world, local_world, device, backend, mesh, owns)


def join_group(backend: str, device: torch.device, timeout_s: int) -> None:
    """init_process_group (env://); rank 0 serves the key-value store at MASTER_ADDR:MASTER_PORT, and a port
    another program holds is a ResourceError saying which."""
    kwargs = {"device_id": device} if backend == "nccl" else {}
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise ResourceError(f"MASTER_PORT: rank 0 cannot serve the run's key-value store at {where}: the port is in "
                            "use (another job, or one still shutting down). Choose a free port (torchrun "
                            "--master_port / MASTER_PORT), or let `kiln train --nproc N` pick one") from None


def check_same_config(cfg, mesh: Mesh, shown: int = 4) -> None:
    """A ConfigError on every process if any was started with another config than rank 0's. On one node every
    process runs the same command; on several, each node's is typed, or its config file read, apart, and a
    node with another train.lr (or model, or data) trained beside the others without a word, its DDP replica
    drifting from rank 0's, whose weights alone are saved."""
    if not mesh.distributed:
        return
    every: list = [None] * mesh.world
    dist.all_gather_object(every, dotted(cfg.model_dump(mode="json")))  # every process judges all alike
    first = every[0]
    odd = [(rank, {k: (c.get(k), first.get(k)) for k in sorted(set(c) | set(first)) if c.get(k) != first.get(k)})
           for rank, c in enumerate(every) if c != first]
    if not odd:
        return
    local = max(1, mesh.local_world)
    lines = []
    for rank, d in odd[:shown]:
        keys = list(d)[:shown]
        lines.append(f"rank {rank} (node {rank // local}) has " + ", ".join(f"{k}={d[k][0]!r}" for k in keys) +
                     " where rank 0 has " + ", ".join(f"{k}={d[k][1]!r}" for k in keys) +
                     (f" (and {len(d) - len(keys)} more)" if len(d) > len(keys) else ""))
    more = f"; {len(odd) - shown} more process(es) differ too" if len(odd) > shown else ""
    raise ConfigError("the processes of this job were started with different configs: " + "; ".join(lines) + more +
                      ". Start the same `kiln train` command on every node, with the same config file (copied to "
                      "every node, or on storage they share) and the same overrides")


def current_mesh(device: torch.device) -> Mesh:
    """The Mesh of a process group someone else initialised (or of one process): for callers without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return Mesh(device=device)
    world = dist.get_world_size()
    return Mesh(dist.get_rank(), env_int("LOCAL_RANK", 0), world, env_int("LOCAL_WORLD_SIZE", world), device,
                dist.get_backend())
