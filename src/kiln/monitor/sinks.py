"""Sinks: callbacks that turn events into a console progress bar and a JSONL metrics file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kiln.train.events import Callback


class ConsoleSink(Callback):
    """A rich progress bar (step, loss, lr, tokens/s, ETA) plus a line per evaluation."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task = None

    def on_train_start(self, trainer) -> None:
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"), BarColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s"),
            TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=trainer.cfg.train.max_steps, completed=trainer.step,
                                           loss="-", lr="-", tps="-")

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        fields = {}
        if metrics:
            fields = dict(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", tps=f"{metrics['tokens_per_s']:,.0f}")
        self.progress.update(self.task, completed=trainer.step, **fields)

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        self.console.print(f"[bold]eval[/] step {metrics['step']}: val_loss {metrics['val_loss']:.4f}  "
                           f"val_ppl {metrics['val_ppl']:.2f}")

    def on_train_end(self, trainer, metrics: dict[str, Any]) -> None:
        if self.progress:
            self.progress.stop()


class JsonlSink(Callback):
    """Appends one JSON object per logged event to `path` (metrics.jsonl in the run directory)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = None

    def _write(self, kind: str, metrics: dict[str, Any]) -> None:
        if self.file is None:
            self.file = open(self.path, "a")
        self.file.write(json.dumps({"event": kind, "time": time.time(), **metrics}) + "\n")
        self.file.flush()

    def on_step_end(self, trainer, metrics) -> None:
        if metrics:
            self._write("train", metrics)

    def on_eval_end(self, trainer, metrics) -> None:
        self._write("eval", metrics)

    def on_train_end(self, trainer, metrics) -> None:
        if self.file:
            self.file.close()
            self.file = None
