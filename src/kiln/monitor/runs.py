"""`kiln runs [DIR]`: the run directories under DIR, one line each, from their files alone.

Status of a run:
- running: a `kiln train` holds its lock (the OS lock of kiln.state.rundir.hold_run_dir, which dies with
  its process, so a killed run is never taken for a running one);
- stopped: its newest checkpoint was written by a stop: early stopping (its stop_reason) or a signal
  (SIGTERM/SIGINT: reason "preempt"); `kiln train RUN` resumes a signalled one;
- finished: its final model is saved, or its final checkpoint reached train.max_steps;
- crashed: anything else (killed, failed, or interrupted before its first checkpoint).

Wall time: the time the run's processes ran, from metrics.jsonl: each process's span from its `start` record
to its last record (its `end`), added up; the days between a stop and its resume do not count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import StateError


@dataclass
class RunSummary:
    name: str
    path: Path
    status: str
    steps: int | None
    tokens: int | None
    best_val_loss: float | None
    last_checkpoint: str | None
    wall_s: float | None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "path": str(self.path)}


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("config.yaml", "metrics.jsonl", "checkpoints"))


def _held(run_dir: Path) -> bool:
    """Whether a live process holds the run directory's lock (a probe: the lock is taken and released at once)."""
    from kiln.files import try_lock
    from kiln.state.rundir import LOCK

    if not (run_dir / LOCK).exists():
        return False
    try:
        with try_lock(run_dir / LOCK) as free:
            return not free
    except OSError:
        return False


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _metrics(run_dir: Path) -> tuple[dict | None, float | None, float | None]:
    """(last train record, best val_loss, wall time) of metrics.jsonl. The wall time is the sum of the spans its
    processes ran: each from its `start` record to its last record (its `end`), so the pauses between a stop and
    its resume are left out; records before the first `start` (a file written before them) are one span."""
    last, best, spans, span = None, None, [], None
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None, None, None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        t = rec.get("time")
        if _number(t):
            if rec.get("event") == "start" or span is None:
                span = [t, t]
                spans.append(span)
            span[1] = max(span[1], t)
            if rec.get("event") == "end":
                span = None
        if rec.get("event") == "train" and isinstance(rec.get("step"), int) and _number(rec.get("tokens", 0)) \
                and (last is None or rec["step"] >= last["step"]):  # a damaged record (a hand edit) is passed over
            last = rec
        val = rec.get("val_loss") if rec.get("event") == "eval" else None
        if _number(val) and (best is None or val < best):
            best = val
    return last, best, sum(b - a for a, b in spans) if spans else None


def summarize(run_dir: str | Path) -> RunSummary:
    from kiln.state.rundir import checkpoints, model_saved
    from kiln.state.verify import read_meta

    run_dir = Path(run_dir)
    ckpts = checkpoints(run_dir)
    meta = None
    if ckpts:
        try:
            meta = read_meta(ckpts[-1])
        except StateError:
            meta = None
    last, best, wall = _metrics(run_dir)
    steps = max([s for s in ((last or {}).get("step"), (meta or {}).get("step")) if s is not None], default=None)
    tokens = max([t for t in ((last or {}).get("tokens"), (meta or {}).get("tokens_seen")) if t is not None],
                 default=None)
    max_steps = ((meta or {}).get("config") or {}).get("train", {}).get("max_steps")
    note = ""
    if _held(run_dir):
        status = "running"
    elif meta is not None and meta.get("stop_reason"):
        status, note = "stopped", str(meta["stop_reason"])
    elif meta is not None and meta.get("reason") == "preempt":
        status, note = "stopped", "by a signal; resume with kiln train RUN"
    elif model_saved(run_dir / "model") or (meta is not None and meta.get("reason") == "final"
                                            and max_steps is not None and meta["step"] >= max_steps):
        status = "finished"
    else:
        status = "crashed"
        if meta is not None and meta.get("reason") == "emergency":
            note = "emergency checkpoint written"
    return RunSummary(run_dir.name, run_dir, status, steps, tokens, best, ckpts[-1].name if ckpts else None, wall,
                      note)


def list_runs(root: str | Path) -> list[RunSummary]:
    """The runs directly under `root` (or `root` itself when it is a run directory), by name."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise StateError(f"{root} is not a directory; give the directory holding your runs (default: runs)")
    if is_run_dir(root) and (root / "config.yaml").is_file():
        return [summarize(root)]
    return [summarize(p) for p in sorted(root.iterdir()) if is_run_dir(p)]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    clock = time.strftime("%H:%M:%S", time.gmtime(s % 86400))
    return clock if s < 86400 else f"{s // 86400}d {clock}"


def runs_table(runs: list[RunSummary], title: str):
    """A rich Table of the runs."""
    from rich.table import Table

    colours = {"running": "cyan", "finished": "green", "stopped": "yellow", "crashed": "red"}
    table = Table(title=title, title_justify="left")
    for name, justify in (("name", "left"), ("status", "left"), ("steps", "right"), ("tokens", "right"),
                          ("best val loss", "right"), ("last checkpoint", "left"), ("wall time", "right")):
        table.add_column(name, justify=justify)
    for r in runs:
        table.add_row(r.name, f"[{colours[r.status]}]{r.status}[/]", f"{r.steps:,}" if r.steps is not None else "-",
                      f"{r.tokens:,}" if r.tokens is not None else "-",
                      f"{r.best_val_loss:.4f}" if r.best_val_loss is not None else "-", r.last_checkpoint or "-",
                      _duration(r.wall_s))
    return table
