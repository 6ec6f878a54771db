"""CPU threads of PyTorch for a run (`train.threads`) or for sampling (`kiln generate --threads`).

PyTorch starts one intra-op thread per physical core. A small model's matrix products are short: the
threads spend much of a step keeping in step, and a thread that waits for a core another process holds
stalls all the others. Measured with benchmarks/threads.py (results/threads.md) on 2 cores: the quickstart
model (4M parameters) trains faster with 1 thread while the machine is loaded and with 2 while it is
idle, and samples (one token at a time) many times faster with 1 thread either way. So by default
(null) a model below SMALL_MODEL parameters trains with as many threads as the machine has idle cores
(`idle_cores`: measured over IDLE_SAMPLE_S at the start, this process's own use left out; at least 1),
samples with 1, and a larger model keeps PyTorch's choice.
"""

from __future__ import annotations

import os
import time

import torch

SMALL_MODEL = 20_000_000  # parameters: below this, threads by the idle cores (see the module doc)
IDLE_SAMPLE_S = 0.25  # how long the machine's CPU use is measured to count its idle cores


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def idle_cores(sample_s: float = IDLE_SAMPLE_S) -> int:
    """Cores of this process's affinity that other processes leave idle now, measured over `sample_s` seconds
    (`idle_of`); at least 1."""
    import psutil

    me = psutil.Process()
    sys0, own0 = psutil.cpu_times(), me.cpu_times()
    time.sleep(sample_s)
    sys1, own1 = psutil.cpu_times(), me.cpu_times()
    own = own1.user + own1.system - own0.user - own0.system
    return idle_of(sys0._asdict(), sys1._asdict(), own, os.cpu_count() or 1, usable_cores())


def idle_of(before: dict[str, float], after: dict[str, float], own_s: float, cpus: int, cores: int) -> int:
    """Idle cores from two readings of the machine's CPU times (psutil.cpu_times, seconds summed over its
    `cpus`) and `own_s`, the CPU seconds this process used between them: the busy time less this process's,
    in cores, taken from the `cores` this process may use, rounded; at least 1."""
    delta = {f: after[f] - before[f] for f in after if f not in ("guest", "guest_nice")}  # in user already
    total = sum(delta.values())
    if total <= 0:
        return 1
    wall = total / cpus  # seconds between the readings
    busy = (total - delta["idle"] - delta.get("iowait", 0.0)) / wall  # cores' worth of busy time
    return max(1, min(cores, round(cores - max(busy - own_s / wall, 0.0))))


def cpu_threads(setting: int | None, n_params: int, sampling: bool = False) -> int | None:
    """Threads for a model of `n_params` on the CPU: `setting` if given; for null, unless OMP_NUM_THREADS
    chose (as torchrun does), for a small model 1 to sample with and the idle cores (up to PyTorch's default)
    to train with; None: keep PyTorch's default."""
    if setting is not None:
        return setting
    if os.environ.get("OMP_NUM_THREADS") or n_params >= SMALL_MODEL:
        return None
    return 1 if sampling else min(idle_cores(), torch.get_num_threads())


def apply_threads(setting: int | None, device: torch.device, n_params: int, sampling: bool = False) -> int:
    """Set PyTorch's intra-op threads for work on `device` (the CPU only: a GPU run keeps PyTorch's
    default) and return the number in force."""
    if device.type == "cpu":
        n = cpu_threads(setting, n_params, sampling)
        if n is not None:
            torch.set_num_threads(n)
    return torch.get_num_threads()
