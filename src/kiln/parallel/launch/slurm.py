"""`kiln launch slurm`: an sbatch script that starts torchrun on every node, rendezvous on the first.

One Slurm task per node runs torchrun (as `kiln train --nproc` runs it: `kiln.parallel.launch.torchrun`, which
does not restart a job whose error a restart would meet again, takes a signal delivered twice once, and
stops its workers if it is killed) with `gpus_per_node` processes; the c10d rendezvous endpoint is
the job's first node, so no port needs to be known beforehand on the others. `--max-restarts` lets
torchrun restart the workers after a failure; they resume from the newest checkpoint in the run
directory, which (with the data cache) must be on storage every node sees. torchrun gets the
environment `kiln train --nproc` gives it (`TORCHRUN_ENV`, exported unless already set), and Slurm sends
SIGTERM to it SIGNAL_S seconds before the time limit, so the workers write a checkpoint and stop in time.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kiln.errors import ConfigError
from kiln.parallel.launch.common import check_shape, given_paths, job_name, resolved_config
from kiln.parallel.launch.torchrun import SHUTDOWN_TIMEOUT_S, TORCHRUN_ENV

PORT = 29500
SIGNAL_S = SHUTDOWN_TIMEOUT_S + 30  # SIGTERM this long before the time limit: torchrun's shutdown timeout and a margin
# Slurm's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]; or no limit
TIME_FORMAT = re.compile(r"(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|unlimited|infinite)", re.IGNORECASE)


def run_directory(run_dir: str | None, job: str, given: str | None = None) -> str:
    """The job's run directory, absolute: `run_dir` (--run-dir), else `given` (the config's train.run_dir),
    else runs/JOB here."""
    def absolute(path: str) -> str:
        return str(Path(path).expanduser().absolute())

    if run_dir and given and absolute(run_dir) != absolute(given):
        raise ConfigError(f"--run-dir {run_dir} and train.run_dir={given} name two run directories; give one")
    return absolute(run_dir or given or f"runs/{job}")


def make_log_dir(run_dir: str) -> str | None:
    """Create the run directory, where Slurm opens the job's output file before the script runs (a missing
    one fails the job without a line of output); a note to print if it cannot be made from here."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return (f"note: could not create the run directory {run_dir} from here ({e.strerror}); create it on the "
                "cluster before sbatch: Slurm writes the job's output there from its first second")
    return None


def _directive(option: str, value: str) -> str:
    """`#SBATCH --option=value`; sbatch splits these lines at spaces, so a value with one is double-quoted."""
    if '"' in value or "\n" in value:
        raise ConfigError(f"--{option} {value!r}: a Slurm directive cannot hold a double quote or a line break")
    return f'--{option}="{value}"' if any(c.isspace() for c in value) else f"--{option}={value}"


def check_options(time_limit: str | None, partition: str | None) -> None:
    if time_limit is not None and not TIME_FORMAT.fullmatch(time_limit):
        raise ConfigError(f"--time {time_limit!r} is not a Slurm time limit; use minutes, HH:MM:SS or D-HH:MM:SS "
                          "(e.g. 1-00:00:00 for one day)")
    if partition is not None and not re.fullmatch(r"[A-Za-z0-9_.,-]+", partition):
        raise ConfigError(f"--partition {partition!r} is not a partition name (letters, digits, '_', '-', '.'; "
                          "several separated by ','); `sinfo -s` lists them")


def script(config: str | None, overrides: list[str], nodes: int, gpus_per_node: int, config_path: str | Path, *,
           name: str | None = None, run_dir: str | None = None, cache_dir: str | None = None,
           time_limit: str | None = None, partition: str | None = None, cpus_per_node: int | None = None,
           max_restarts: int = 3) -> tuple[str, str]:
    """(the sbatch script, the resolved config YAML to write at `config_path`)."""
    check_shape(nodes, gpus_per_node)
    check_options(time_limit, partition)
    job = job_name(config, name)
    given_run, given_cache = given_paths(config, overrides)  # train.run_dir and data.cache_dir, if set
    run_dir = run_directory(run_dir, job, given_run)
    cache_dir = str(Path(cache_dir or given_cache or "~/.cache/kiln").expanduser().absolute())
    cfg = resolved_config(config, overrides, run_dir, cache_dir)
    cfg_file = shlex.quote(str(Path(config_path).absolute()))
    directives = [f"--job-name={job}", f"--nodes={nodes}", "--ntasks-per-node=1", f"--gpus-per-node={gpus_per_node}",
                  "--exclusive", _directive("output", f"{run_dir}/slurm-%j.out"), f"--signal=TERM@{SIGNAL_S}"]
    if cpus_per_node:
        directives.append(f"--cpus-per-task={cpus_per_node}")
    if time_limit:
        directives.append(f"--time={time_limit}")
    if partition:
        directives.append(f"--partition={partition}")
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
             f"# kiln: {nodes} node(s) x {gpus_per_node} GPU(s). The run directory {run_dir} and the cache",
             f"# {cache_dir} must be on storage every node sees. Submit: sbatch THIS_FILE",
             "set -euo pipefail",
             f"mkdir -p {shlex.quote(run_dir)}",
             # sed reads to the end: with `head -n 1`, scontrol could die of SIGPIPE and, under pipefail, end the job
             'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
             "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
             *(f"export {k}=${{{k}:-{v}}}" for k, v in TORCHRUN_ENV.items()),
             "srun --kill-on-bad-exit=1 python -m kiln.parallel.launch.torchrun \\",
             '  --nnodes="$SLURM_JOB_NUM_NODES" \\',
             f"  --nproc_per_node={gpus_per_node} \\",
             '  --rdzv_id="$SLURM_JOB_ID" \\',
             "  --rdzv_backend=c10d \\",
             f'  --rdzv_endpoint="$head_node:{PORT}" \\',
             f"  --max-restarts={max_restarts} \\",
             f"  -m kiln.cli train {cfg_file}", ""]
    return "\n".join(lines), cfg.to_yaml()
