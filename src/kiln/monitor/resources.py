"""The resource monitor: what the machine is doing, sampled off the training loop, and a warning when
something is about to go wrong.

At every logging step the monitor hands its newest sample to the step's metrics (keys `sys/...`, so
every sink records them) and asks its thread for the next one; the thread reads GPU utilisation,
memory, power, temperature, clocks and throttling (NVML), the CPU and resident memory of this
process and its children (psutil), their disk read/write rates, and the free space of the run and
cache directories. Nothing here waits for the GPU.

It warns (console, and an `on_notice` "warning" that reaches every sink) when: the loop waits for data
more than monitor.data_wait_warn of the time over a window of logging intervals (the loader's warm-up
left out: `DataWait`); the host's memory is fuller than monitor.host_memory_warn; a GPU's memory is
fuller than monitor.gpu_memory_warn; the run directory's disk has less free space than
monitor.disk_checkpoints_warn checkpoints (checked before every save: the checkpointer's room check
calls `before_save`, and a save that cannot fit at all is refused there); the GPU slows itself
down for heat or power. Each condition warns once, and the data wait and host memory warn again after
they have recovered (said too), so a slowdown late in a run is reported as one early on is.

Beside the sample, each logging step's metrics get this process's peak resident memory since the last
record (`sys/peak_rss_gib`, `PeakRss`: read in the loop, where the sample is taken after the record and
reports the interval before it).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.config import MonitorConfig
from kiln.events import Callback

PREFIX = "sys/"


def size(n: float) -> str:
    """Bytes for people: 812 MB, 13.2 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def percent(fraction: float) -> str:
    """A fraction for people, with the digits it needs: 10%, 0.5%, 10.4%, 33.3%."""
    return f"{fraction * 100:.3g}%"


def _status_kb(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))
    except (OSError, AttributeError, ValueError):
        return None


class PeakRss:
    """This process's peak resident memory since the last `read`, without touching the process's own lifetime peak
    (which `/usr/bin/time` and the scheduler's accounting report): when the lifetime peak (VmHWM) rose since the last
    read, the new high came in this interval and is the answer; else the highest of the resident sizes `poll` saw
    (the monitor's thread polls every POLL_S seconds) and the one now. None off Linux."""

    POLL_S = 0.2

    def __init__(self):
        self.hwm = 0  # kB: the lifetime peak at the last read
        self.polled = 0  # kB: the highest resident size polled since the last read
        self._lock = threading.Lock()

    def poll(self) -> None:
        now = _status_kb("VmRSS")
        if now is not None:
            with self._lock:
                self.polled = max(self.polled, now)

    def read(self) -> float | None:
        """GiB, or None when it cannot be read."""
        hwm, now = _status_kb("VmHWM"), _status_kb("VmRSS")
        if hwm is None or now is None:
            return None
        with self._lock:
            peak = hwm if hwm > self.hwm else max(self.polled, now)
            self.hwm, self.polled = hwm, 0
        return peak / 2**20


class DataWait:
    """The fraction of time the loop waited for data over the last `size` logging intervals, weighted by their
    steps; None while the window is not full. The first interval after a start and those ending within the first
    `warmup` steps are the loader's warm-up (buffers filling, files opening) and are left out."""

    def __init__(self, size: int = 5, warmup: int = 10):
        self.size, self.warmup = size, warmup
        self.window: deque[tuple[int, float]] = deque(maxlen=size)
        self.begin(0)

    def begin(self, step: int) -> None:
        self.start = self.prev = step
        self.seen = 0
        self.window.clear()

    def add(self, step: int, wait: float) -> float | None:
        steps, self.prev = step - self.prev, step
        self.seen += 1
        if self.seen == 1 or step - self.start <= self.warmup or steps <= 0:  # warm-up; a rollback's way back
            return None
        self.window.append((steps, wait))
        if len(self.window) < self.size:
            return None
        return sum(n * w for n, w in self.window) / sum(n for n, _ in self.window)


def free_bytes(path: Path) -> int | None:
    """Free space of the disk holding `path` (its nearest existing parent), None if unreadable."""
    path = Path(path).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class Sampler:
    """One sample of this process tree and its disks (and its GPU when `gpu` reads one). `clock` gives
    seconds (tests pass a fake); rates are the change since the previous sample."""

    def __init__(self, run_dir: Path, cache_dir: Path | None = None, gpu: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        import psutil

        self.psutil, self.gpu, self.clock = psutil, gpu, clock
        self.run_dir, self.cache_dir = Path(run_dir), (Path(cache_dir).expanduser() if cache_dir else None)
        self.root = psutil.Process(os.getpid())
        self._procs: dict[int, Any] = {}  # kept between samples: cpu_percent measures since the last call
        self._io: tuple[float, int, int] | None = None

    def _tree(self) -> list[Any]:
        try:
            found = [self.root, *self.root.children(recursive=True)]
        except self.psutil.Error:
            found = [self.root]
        procs = {p.pid: self._procs.get(p.pid, p) for p in found}
        self._procs = procs
        return list(procs.values())

    def sample(self) -> dict[str, float]:
        ps = self.psutil
        cpu = rss = 0.0
        read = write = 0
        io_ok = True
        for p in self._tree():
            try:
                with p.oneshot():
                    cpu += p.cpu_percent(None)
                    rss += p.memory_info().rss
                    if io_ok:
                        io = p.io_counters()
                        read, write = read + io.read_bytes, write + io.write_bytes
            except (ps.NoSuchProcess, ps.ZombieProcess):
                continue
            except (ps.AccessDenied, AttributeError, NotImplementedError):
                io_ok = False  # no per-process counters here (macOS, restricted /proc): whole-system below
        if not io_ok:
            counters = ps.disk_io_counters()
            read, write = (counters.read_bytes, counters.write_bytes) if counters else (0, 0)
        out = {"cpu_percent": cpu, "rss_gib": rss / 2**30, "host_mem_percent": ps.virtual_memory().percent}
        now = self.clock()
        if self._io is not None and now > self._io[0]:
            dt = now - self._io[0]
            out["disk_read_mb_s"] = max(read - self._io[1], 0) / dt / 1e6
            out["disk_write_mb_s"] = max(write - self._io[2], 0) / dt / 1e6
        self._io = (now, read, write)
        for name, path in (("run", self.run_dir), ("cache", self.cache_dir)):
            free = free_bytes(path) if path is not None else None
            if free is not None:
                out[f"disk_free_gb_{name}"] = free / 1e9
        if self.gpu is not None:
            try:
                out.update(self.gpu.read())
            except Exception:  # noqa: BLE001 - a GPU reading that fails loses those keys, not the run
                pass
        return out


def gpu_reader(device, log: Callable[[str], None]):
    """An NVML reader for a CUDA `device`, or None (CPU, or nvidia-ml-py missing: then one line says so)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    try:
        import torch

        from kiln.monitor.nvml import NvmlReader

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "") or None
        return NvmlReader(index, uuid)
    except ImportError:
        log("resource monitor: no GPU utilisation, power or temperature without nvidia-ml-py: "
            "pip install 'kiln[gpu]'")
    except Exception as e:  # noqa: BLE001 - NVML present but unusable (no driver access in a container)
        log(f"resource monitor: NVML unavailable ({e}); GPU readings are off")
    return None


class ResourceMonitor(Callback):
    """Register it first among the callbacks, so the sinks after it see the `sys/...` metrics.

    `sampler` is a `Sampler` (or anything with `.sample()`); `checkpoint_bytes` the expected size of a
    checkpoint until the checkpointer reports a real one. `thread=False` samples inline (tests)."""

    def __init__(self, cfg: MonitorConfig, sampler, checkpoint_bytes: int, log: Callable[[str], None] = print,
                 thread: bool = True):
        self.cfg, self.sampler, self.log = cfg, sampler, log
        self.checkpoint_bytes = checkpoint_bytes
        self.latest: dict[str, float] = {}
        self.warned: set[str] = set()
        self.waits, self.peak = DataWait(), PeakRss()
        self.pending: list[dict[str, Any]] = []  # warnings waiting for the main thread to emit them
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kiln-resources", daemon=True) if thread else None

    # ------------------------------------------------------------------ sampling thread

    def _loop(self) -> None:
        while True:
            if not self._wake.wait(self.peak.POLL_S):  # between samples: the process's resident size, for its peak
                self.peak.poll()
                continue
            self._wake.clear()
            if self._stop.is_set():
                return
            self._take()

    def _take(self) -> None:
        try:
            values = self.sampler.sample()
        except Exception as e:  # noqa: BLE001 - monitoring never stops a run
            self.warn("sampler", f"resource monitor: sampling failed ({e}); its readings stop", {})
            return
        with self._lock:
            self.latest = values

    def request(self) -> None:
        """Take the next sample (in the thread; inline without one)."""
        if self._thread is None:
            self._take()
        else:
            self._wake.set()

    # ------------------------------------------------------------------ warnings

    def warn(self, key: str, message: str, data: dict[str, Any]) -> None:
        """Say `message` once per `key` (until `recovered(key)`), on the console and as an event for the sinks."""
        with self._lock:
            if key in self.warned:
                return
            self.warned.add(key)
            self.pending.append({"condition": key, "message": message, **data})
        self.log(f"warning: {message}")

    def recovered(self, key: str, message: str) -> None:
        """The condition `key` warned of is over: say so, and warn again if it comes back."""
        with self._lock:
            if key not in self.warned:
                return
            self.warned.discard(key)
        self.log(message)

    def _flush(self, trainer) -> None:
        with self._lock:
            pending, self.pending = self.pending, []
        for item in pending:
            trainer.events.emit("on_notice", trainer, "warning", {"step": trainer.step, **item})

    def check(self, values: dict[str, float], data_wait: float | None) -> None:
        """Apply the warning rules to a sample (and the loop's data-wait fraction over the window, None while it
        fills)."""
        c = self.cfg
        if data_wait is not None and data_wait > c.data_wait_warn:
            self.warn("data_wait", f"the training loop waited for data {percent(data_wait)} of the time over the "
                      f"last {self.waits.size} logging intervals (more than monitor.data_wait_warn="
                      f"{percent(c.data_wait_warn)}): raise data.prefetch, prepare the data ahead "
                      "(data.streaming=false), or put it on a faster disk", {"data_wait": data_wait})
        elif data_wait is not None and data_wait <= c.data_wait_warn / 2:
            self.recovered("data_wait", f"the training loop waits for data {percent(data_wait)} of the time again "
                           f"(under monitor.data_wait_warn={percent(c.data_wait_warn)})")
        used = values.get("host_mem_percent")
        if used is not None and used / 100 > c.host_memory_warn:
            self.warn("host_memory", f"host memory is {used:.0f}% used (over monitor.host_memory_warn="
                      f"{percent(c.host_memory_warn)}): the kernel ends a process without a word when it runs out; "
                      "lower data.prefetch or data.workers, turn checkpoint.async_save or recovery.rollback off "
                      "(each holds a copy of the state in host memory), or free memory on this machine",
                      {"host_mem_percent": used})
        elif used is not None and used / 100 <= c.host_memory_warn - 0.05:
            self.recovered("host_memory", f"host memory is {used:.0f}% used again (under monitor.host_memory_warn)")
        frac = values.get("gpu_mem_frac")
        if frac is not None and frac > c.gpu_memory_warn:
            self.warn("gpu_memory", f"GPU memory is {frac:.0%} full (over monitor.gpu_memory_warn="
                      f"{c.gpu_memory_warn:.0%}): an out-of-memory error is near; lower train.batch_size or use "
                      "train.activation_checkpointing", {"gpu_mem_frac": frac})
        if values.get("gpu_throttle_thermal"):
            self.warn("thermal", f"the GPU is slowing itself down for heat ({values.get('gpu_temp_c', '?')} C): "
                      "check its cooling; throughput drops while it lasts", {"gpu_temp_c": values.get("gpu_temp_c")})
        if values.get("gpu_throttle_power"):
            self.warn("power", f"the GPU is held at its power limit ({values.get('gpu_power_w', 0):.0f} W): "
                      "clocks and throughput drop while it lasts", {"gpu_power_w": values.get("gpu_power_w")})
        free = values.get("disk_free_gb_run")
        if free is not None:
            self._disk(free * 1e9, self.checkpoint_bytes, "at a logging step")

    def _disk(self, free: float, checkpoint: int, when: str) -> None:
        k = self.cfg.disk_checkpoints_warn
        if k and checkpoint and free < k * checkpoint:
            self.warn("disk", f"only {size(free)} free on the run directory's disk ({when}), less than "
                      f"{k:g} checkpoints of {size(checkpoint)} (monitor.disk_checkpoints_warn): a save "
                      "will soon not fit; free space, lower checkpoint.keep_last or move train.run_dir",
                      {"disk_free_gb": free / 1e9, "checkpoint_gb": checkpoint / 1e9})

    def before_save(self, step: int, free: int, needed: int) -> None:
        """The checkpointer's room check, before every save: `needed` bytes for this checkpoint, `free` now."""
        self.checkpoint_bytes = needed
        self._disk(free, needed, f"before the checkpoint of step {step}")

    # ------------------------------------------------------------------ events

    def on_train_start(self, trainer) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self._thread.start()
        self.waits.begin(trainer.step)
        self.peak.read()  # the peaks of start-up (data preparation) are not the first interval's
        self._take()  # here, not in the thread: the first logging step's record already has every reading

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if metrics is not None:
            with self._lock:
                values = dict(self.latest)
            metrics.update({PREFIX + k: v for k, v in values.items()})
            peak = self.peak.read()
            if peak is not None:
                metrics[PREFIX + "peak_rss_gib"] = peak
            wait = metrics.get("data_wait")
            self.check(values, None if wait is None else self.waits.add(trainer.step, wait))
            self.request()
        self._flush(trainer)

    def on_train_end(self, trainer, metrics: dict[str, Any]) -> None:
        self._flush(trainer)
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        close = getattr(getattr(self.sampler, "gpu", None), "close", None)
        if close is not None:
            close()
