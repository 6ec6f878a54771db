"""`kiln train CONFIG --nproc N`: start torchrun on this machine, which runs `kiln train CONFIG` N times.

`--max-restarts K` lets torchrun restart the job K times after a process dies (each start resumes from
the newest checkpoint by itself). SIGTERM to this process (a scheduler preempting the job) is passed
to torchrun, which passes it to every worker; each writes its part of one checkpoint and exits. torchrun
kills workers that take longer than its shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by
default); this sets it to SHUTDOWN_TIMEOUT_S unless the environment already does, since a large
model's preemption checkpoint can take longer than 30 s to write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kiln.errors import ConfigError

SHUTDOWN_TIMEOUT_S = 120  # seconds torchrun gives its workers between SIGTERM and SIGKILL
# What torchrun needs in its environment for kiln, wherever it is started (here, and in the Kubernetes and
# Slurm launch files); each is a default that the environment may override:
TORCHRUN_ENV = {
    # time for the preemption checkpoint: torchrun passes SIGTERM to the workers, then kills them after this
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S),
    # a restarted job needs a fresh key-value store: in the one torchrun shares across restarts, the new
    # processes read the dead ones' addresses and gloo's first connection fails (torch 2.13)
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}
LAUNCH_OPTIONS = ("--nproc", "--max-restarts")  # options of `kiln train` that torchrun's command drops


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


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


def torchrun_command(nproc: int, train_args: list[str], max_restarts: int = 0) -> list[str]:
    """The torchrun command line of a one-machine run of `kiln train *train_args` on `nproc` processes."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    # torchrun itself, ending a failed job without burying the error a rank printed (kiln.dist.launch.torchrun)
    return [sys.executable, "-m", "kiln.dist.launch.torchrun", "--standalone", f"--nproc_per_node={nproc}", *restarts,
            "-m", "kiln.cli", "train", *train_args]


def relaunch(nproc: int, argv: list[str] | None = None, max_restarts: int = 0) -> int:
    """Run this `kiln train` under torchrun with `nproc` processes; returns torchrun's exit code."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of processes to start, 1 or more")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: give how often torchrun may restart the job, 0 or more")
    if under_torchrun():
        raise ConfigError("--nproc is for starting torchrun; this process already runs under torchrun, so drop "
                          "--nproc and --max-restarts (torchrun's --nproc_per_node says how many processes)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = without_nproc(argv[argv.index("train") + 1:] if "train" in argv else argv)
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name, value in TORCHRUN_ENV.items():
        env.setdefault(name, value)
    proc = subprocess.Popen(torchrun_command(nproc, args, max_restarts), env=env)
    # a scheduler's SIGTERM comes to this process alone: torchrun passes it on to the workers
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # torchrun got the Ctrl-C too and stops its workers; wait for it
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
