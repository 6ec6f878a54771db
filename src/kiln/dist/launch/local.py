"""`kiln train CONFIG --nproc N`: start torchrun on this machine, which runs `kiln train CONFIG` N times."""

from __future__ import annotations

import os
import subprocess
import sys

from kiln.errors import ConfigError


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` less its --nproc option (both `--nproc N` and `--nproc=N`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """The torchrun command line of a one-machine run of `kiln train *train_args` on `nproc` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "kiln.cli", "train", *train_args]


def relaunch(nproc: int, argv: list[str] | None = None) -> int:
    """Run this `kiln train` under torchrun with `nproc` processes; returns torchrun's exit code."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of processes to start, 1 or more")
    if under_torchrun():
        raise ConfigError("--nproc is for starting torchrun; this process already runs under torchrun, so drop "
                          "--nproc (torchrun's --nproc_per_node says how many processes)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = without_nproc(argv[argv.index("train") + 1:] if "train" in argv else argv)
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(torchrun_command(nproc, args), env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # torchrun got the Ctrl-C too and stops its workers; wait for it
            continue
