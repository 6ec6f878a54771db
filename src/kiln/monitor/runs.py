"""`kiln runs [DIR]`: the run directories under DIR, one line each, from their files alone.

Status of a run, told by its lock, then by how its last process ended (the `start` and `end` records each
process writes to metrics.jsonl), then by its newest checkpoint:
- running: a `kiln train` holds its lock (the OS lock of kiln.state.rundir.hold_run_dir, which dies with
  its process, so a killed run is never taken for a running one);
- stopped: early stopping stopped it (its checkpoint's stop_reason), or a signal (SIGTERM/SIGINT) did, its
  checkpoint written; `kiln train RUN` resumes a signalled one;
- finished: its last process ended its training and saved the model, at the train.max_steps of the run's
  config.yaml (a run extended with `--resume force` is finished again only when it reaches its new end);
- failed: its last process stopped on an error (an emergency checkpoint is written when the state allowed);
- killed: its last process started and never wrote its end: killed (SIGKILL, out of host memory, a node lost);
- crashed: one of the last two, when the run's metrics.jsonl cannot tell (written without start and end
  records, or logging.jsonl off).

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


def _metrics(run_dir: Path) -> tuple[dict | None, float | None, float | None, str | None]:
    """(last train record, best val_loss, wall time, how the last process ended) of metrics.jsonl. The wall time
    is the sum of the spans its processes ran: each from its `start` record to its last record (its `end`), so
    the pauses between a stop and its resume are left out; records before the first `start` (a file written
    before them) are one span. The last process's end: the status of its `end` record, "killed" when it has
    none, None when the file has no `start` record."""
    last, best, spans, span, ended = None, None, [], None, None
    try:
        lines = (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines()  # a damaged byte: its line
    except OSError:
        return None, None, None, None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("event") in ("start", "end"):
            ended = "killed" if rec["event"] == "start" else str(rec.get("status"))
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
    return last, best, sum(b - a for a, b in spans) if spans else None, ended


def _max_steps(run_dir: Path, meta: dict | None) -> int | None:
    """train.max_steps of the run now: its config.yaml (written by each start, a forced resume's included), else
    its newest checkpoint's."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        steps = cfg["train"]["max_steps"]
        if isinstance(steps, int):
            return steps
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        pass
    return ((meta or {}).get("config") or {}).get("train", {}).get("max_steps")


def _status(run_dir: Path, meta: dict | None, ended: str | None, steps: int | None) -> tuple[str, str]:
    from kiln.state.rundir import model_saved

    max_steps = _max_steps(run_dir, meta)
    reached = steps is not None and max_steps is not None and steps >= max_steps
    reason = (meta or {}).get("reason")
    if _held(run_dir):
        return "running", ""
    if ended in (None, "finished", "stopped") and meta is not None and meta.get("stop_reason"):
        return "stopped", str(meta["stop_reason"])
    if ended == "stopped" or (ended is None and reason == "preempt"):
        return "stopped", "by a signal; resume with kiln train RUN"
    if ended == "finished" or (ended is None and reached and (reason == "final" or model_saved(run_dir / "model"))):
        if reached or max_steps is None:
            return "finished", ""
        return "killed", f"ended at step {steps} of {max_steps} without a word; resume with kiln train RUN"
    emergency = "; an emergency checkpoint is written" if reason == "emergency" else ""
    if ended == "failed":
        return "failed", f"stopped on an error{emergency}; its log says which"
    if ended is not None:
        return "killed", (f"its process ended without a word after step {steps} (killed, out of memory, a node "
                          "lost); resume with kiln train RUN")
    return "crashed", emergency[2:]


def summarize(run_dir: str | Path) -> RunSummary:
    from kiln.state.rundir import checkpoints
    from kiln.state.verify import read_meta

    run_dir = Path(run_dir)
    ckpts = checkpoints(run_dir)
    meta = None
    if ckpts:
        try:
            meta = read_meta(ckpts[-1])
        except StateError:
            meta = None
    last, best, wall, ended = _metrics(run_dir)
    steps = max([s for s in ((last or {}).get("step"), (meta or {}).get("step")) if s is not None], default=None)
    tokens = max([t for t in ((last or {}).get("tokens"), (meta or {}).get("tokens_seen")) if t is not None],
                 default=None)
    status, note = _status(run_dir, meta, ended, steps)
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

    colours = {"running": "cyan", "finished": "green", "stopped": "yellow", "crashed": "red", "failed": "red",
               "killed": "red"}
    table = Table(title=title, title_justify="left")
    for name, justify in (("name", "left"), ("status", "left"), ("steps", "right"), ("tokens", "right"),
                          ("best val loss", "right"), ("last checkpoint", "left"), ("wall time", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "name")
    for r in runs:
        table.add_row(r.name, f"[{colours[r.status]}]{r.status}[/]", f"{r.steps:,}" if r.steps is not None else "-",
                      f"{r.tokens:,}" if r.tokens is not None else "-",
                      f"{r.best_val_loss:.4f}" if r.best_val_loss is not None else "-", r.last_checkpoint or "-",
                      _duration(r.wall_s))
    return table
