"""What the benchmark scripts share: the device and its memory, timing between device synchronisations,
the record of where and how a result was measured, tables, and the Hugging Face Trainer's side of a
comparison (rows of tokens, a step clock)."""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def device(choice: str = "auto") -> torch.device:
    """`choice`, or CUDA where there is a GPU and else the CPU ('auto')."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice)


def sync(dev: torch.device | None = None) -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    """Drop what the previous run left: Python garbage, compiled graphs, cached GPU memory and its peak."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """Peak GPU memory allocated since the last `free()` (0.0 without a GPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def timed(fn: Callable[[], Any], dev: torch.device | None = None) -> tuple[float, Any]:
    """(seconds, result) of one call of `fn`, between two device synchronisations."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def seconds_per_call(fn: Callable[[], Any], calls: int, warmup: int = 0, dev: torch.device | None = None) -> float:
    """Mean seconds of `calls` calls of `fn` after `warmup` untimed ones (compilation, allocator)."""
    for _ in range(warmup):
        fn()
    return timed(lambda: [fn() for _ in range(calls)], dev)[0] / calls


def device_name(dev: torch.device | None = None) -> str:
    """The card's name on CUDA, else the CPU's."""
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def run_info(dev: torch.device | None = None, packages: Sequence[str] = (), **more: Any) -> dict[str, Any]:
    """Where and how a result was measured, for its JSON: date, the command line, the device, the CPUs, the
    versions of Python, torch, kiln and `packages` (those installed), then `more`."""
    import kiln

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", *sys.argv]), "device": device_name(dev), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "kiln": kiln.__version__}
    for name in packages:
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    return {**info, **more}


def write_json(path: str | Path | None, data: Any) -> None:
    """Write `data` as JSON to `path` (nothing without one); called as results come, a run cut short keeps its
    numbers."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def _cell(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and value != value and spec):  # missing, or NaN
        return "-"
    if isinstance(value, str) or not spec:
        return str(value)
    return spec.format(value) if "{" in spec else format(value, spec)


def table(rows: Sequence[dict], columns: Sequence[tuple], markdown: bool = False) -> str:
    """`rows` as a table: one column per (title, key or function of the row, format spec) in `columns`; a spec
    with braces is a format string ("{:.2f}x"). Columns with numbers are right-aligned, those of text alone
    left-aligned; a missing value (None, NaN) shows as '-'. `markdown`: a Markdown table, else plain text."""
    values = [[col[1](r) if callable(col[1]) else r.get(col[1]) for col in columns] for r in rows]
    cells = [[_cell(v, col[2] if len(col) > 2 else "") for v, col in zip(row, columns)] for row in values]
    numeric = [any(isinstance(row[i], int | float) for row in values) for i in range(len(columns))]
    titles = [col[0] for col in columns]
    if markdown:
        lines = ["| " + " | ".join(titles) + " |", "|" + "|".join(" ---: " if n else " --- " for n in numeric) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])
    widths = [max([len(t), *(len(row[i]) for row in cells)]) for i, t in enumerate(titles)]

    def line(values):
        return " ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(titles), *(line(row) for row in cells)])


def hf_rows(rows: torch.Tensor):
    """A `torch.utils.data.Dataset` for the Hugging Face Trainer: `rows` (N, T) of token ids, cycled without
    end, each its own labels (the model shifts them)."""

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            r = rows[i % len(rows)]
            return {"input_ids": r, "labels": r}

    return Rows()


def hf_step_clock(start: int, end: int):
    """A `transformers.TrainerCallback` that times steps `start` to `end` between two device synchronisations
    (`seconds` once they ran) and keeps every logged loss (`losses`)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.t0, self.seconds, self.losses = 0.0, None, []

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == start:
                sync()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == end:
                sync()
                self.seconds = time.perf_counter() - self.t0

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    return StepClock()
