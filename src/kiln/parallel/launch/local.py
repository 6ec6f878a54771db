"""`kiln train CONFIG --nproc N`: start torchrun on this machine, which runs `kiln train CONFIG` N times.

`--max-restarts K` lets torchrun restart the job K times after a process dies (each start resumes from
the newest checkpoint by itself). SIGTERM to this process (a scheduler preempting the job; SIGINT and
SIGHUP too) is passed to torchrun, which passes it to every worker; each writes its part of one checkpoint
and exits. torchrun kills workers that take longer than its shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
30 s by default); this sets it to SHUTDOWN_TIMEOUT_S (kiln.parallel.launch.torchrun) unless the environment
already does, since a large model's preemption checkpoint can take longer than 30 s to write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kiln.errors import ConfigError, ResourceError
from kiln.parallel.launch.torchrun import PARENT_PID, TORCHRUN_ENV

PROCESS_BYTES = 1 << 29  # host memory one CPU training process takes at the least (torch and its threads: ~0.35 GiB)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # passed on to torchrun, which stops the job on them
LAUNCH_OPTIONS = ("--nproc", "--max-restarts")  # options of `kiln train` that torchrun's command drops


def under_torchrun() -> bool:
    from kiln.parallel.env import env_int

    world = env_int("WORLD_SIZE", 1, "unset it for `kiln train --nproc N`, which starts torchrun")
    return "TORCHELASTIC_RUN_ID" in os.environ or world > 1


def cuda_available() -> bool:
    import torch  # 2 s: a launcher of CPU processes never imports it

    return torch.cuda.is_available()


def check_world(cfg, nproc: int, log=print) -> None:
    """What `nproc` processes of `cfg` on this machine cannot do, found before torchrun starts any: one error,
    once, instead of one from every process (or an out-of-memory machine)."""
    from kiln.parallel.env import check_backend

    cfg.lora.require_base(cfg.model)  # else said by every process, and again at every restart
    cfg.train.loader_rows(nproc)  # a train.global_batch_tokens that nproc ranks cannot share (or batch_size cut)
    if cfg.train.offload != "none" and nproc > 1:  # kiln.parallel.offload: else refused by a rank, after its data
        raise ConfigError(f"train.offload={cfg.train.offload} runs in one process on one GPU, and --nproc {nproc} "
                          f"starts {nproc}: start one (kiln train without --nproc), or remove train.offload and let "
                          "FSDP shard the state over the processes (dist.cpu_offload offloads it under FSDP)")
    d, name = cfg.dist, cfg.train.device
    cuda = name.startswith("cuda") or (name == "auto" and cuda_available())
    check_backend(d.backend, cuda, name)
    if d.sharding == "hybrid" and d.strategy != "ddp" and d.replicas is not None and nproc % d.replicas:
        raise ConfigError(f"dist.replicas={d.replicas} does not divide the {nproc} processes of --nproc {nproc}; "
                          f"choose a divisor of {nproc}, or leave dist.replicas unset (one replica per node)")
    if cuda:
        import torch

        if name not in ("auto", "cuda") and nproc > 1:
            raise ConfigError(f"train.device={name} names one GPU for all {nproc} processes; each process needs its "
                              "own: use train.device=cuda (process i drives GPU i), and CUDA_VISIBLE_DEVICES to "
                              "choose which GPUs")
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise ResourceError(f"train.device={name}, but no CUDA GPU is visible here; use train.device=cpu")
        if nproc > gpus:
            raise ResourceError(f"--nproc {nproc}: this machine has {gpus} GPU(s) visible, one per process; start at "
                                f"most {gpus} (or train on the CPU with train.device=cpu)")
        return
    import psutil

    cores, free = os.cpu_count() or 1, psutil.virtual_memory().available
    if nproc * PROCESS_BYTES > free:
        raise ResourceError(f"--nproc {nproc}: {nproc} CPU training processes need at least "
                            f"{nproc * PROCESS_BYTES / 2**30:.0f} GiB of memory and {free / 2**30:.1f} GiB are free; "
                            f"start fewer (this machine has {cores} CPU cores)")
    if nproc > cores:
        log(f"warning: --nproc {nproc} on {cores} CPU cores: the processes take turns on the cores, so this run is "
            f"slower than with --nproc {cores} or fewer")


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` less its launch options (--nproc and --max-restarts, as `--opt N` or `--opt=N`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in LAUNCH_OPTIONS:
            skip = True
            continue
        if arg.startswith(tuple(f"{o}=" for o in LAUNCH_OPTIONS)):
            continue
        out.append(arg)
    return out


def torchrun_command(nproc: int, train_args: list[str], max_restarts: int = 0, command: str = "train") -> list[str]:
    """The torchrun command line of a one-machine run of `kiln COMMAND *train_args` on `nproc` processes."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    # torchrun itself, ending a failed job without burying the error a rank printed (kiln.parallel.launch.torchrun)
    return [sys.executable, "-m", "kiln.parallel.launch.torchrun", "--standalone", f"--nproc_per_node={nproc}",
            *restarts, "-m", "kiln.cli", command, *train_args]


def relaunch(nproc: int, argv: list[str] | None = None, max_restarts: int = 0, cfg=None, command: str = "train") -> int:
    """Run this `kiln train` (or `kiln COMMAND`) under torchrun with `nproc` processes; returns torchrun's exit
    code. `cfg` (the run's config) is checked against `nproc` and this machine first."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of processes to start, 1 or more")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: give how often torchrun may restart the job, 0 or more")
    if under_torchrun():
        raise ConfigError("--nproc is for starting torchrun; this process already runs under torchrun, so drop "
                          "--nproc and --max-restarts (torchrun's --nproc_per_node says how many processes)")
    if cfg is not None:
        check_world(cfg, nproc)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = without_nproc(argv[argv.index(command) + 1:] if command in argv else argv)
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name, value in TORCHRUN_ENV.items():
        env.setdefault(name, value)
    env[PARENT_PID] = str(os.getpid())  # torchrun stops its workers if this process is killed
    proc = subprocess.Popen(torchrun_command(nproc, args, max_restarts, command), env=env)
    # a scheduler's SIGTERM (or a SIGINT, a SIGHUP sent with kill) comes to this process alone: torchrun passes it
    # on to the workers. A Ctrl-C reaches torchrun too, and this copy within DUPLICATE_S counts once there.
    # SIGHUP stays ignored under nohup.
    forwarded = [s for s in FORWARDED if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum)) for s in forwarded}
    previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, signal.SIG_IGN)  # Ctrl-Z: torchrun says why not
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code < 0:  # torchrun itself was killed; its workers are sent SIGTERM (kiln.parallel.launch.torchrun)
        print(f"kiln: torchrun was killed by {signal.Signals(-code).name}; its workers are told to stop as on "
              "SIGTERM (their last lines say how to resume)", file=sys.stderr, flush=True)
        return 128 - code
    return code
