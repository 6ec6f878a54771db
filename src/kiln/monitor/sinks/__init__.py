"""Sinks: callbacks that turn events into a console progress bar and a JSONL metrics file (here), and
into TensorBoard, Weights & Biases, MLflow and Prometheus (a module each, their packages extras that
are imported only when enabled). `enabled_sinks` builds the ones `logging:` turns on."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kiln.events import Sink
from kiln.files import atomic_write
from kiln.monitor.progress import ProgressLines


class ConsoleSink(Sink):
    """A rich progress bar (step, loss, lr, tokens/s, ETA) plus a line per evaluation. When the console is not a
    terminal (a log file), a plain line per logging step instead (`kiln.monitor.progress`): a bar is drawn
    there only once, at its end."""

    name = "console"

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task = None
        self.lines: ProgressLines | None = None

    def on_train_start(self, trainer) -> None:
        if not self.console.is_terminal:
            self.lines = ProgressLines(lambda s: self.console.print(s, markup=False, highlight=False, soft_wrap=True),
                                       trainer.cfg.train.max_steps)
            self.lines.begin(trainer.step)
            return
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"), BarColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s"),
            TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=trainer.cfg.train.max_steps, completed=trainer.step,
                                           loss="-", lr="-", tps="-")

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if self.lines is not None:
            if metrics:
                self.lines(trainer.step, metrics)
            return
        fields = {}
        if metrics:
            fields = dict(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                          tps=f"{metrics['tokens_per_s']:,.0f}")
        self.progress.update(self.task, completed=trainer.step, **fields)

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        self.console.print(f"[bold]eval[/] step {metrics['step']}: val_loss {metrics['val_loss']:.4f}  "
                           f"val_ppl {metrics['val_ppl']:.2f}"
                           + (f"  val_bpb {metrics['val_bpb']:.4f}" if "val_bpb" in metrics else ""))

    def on_notice(self, trainer, kind: str, info: dict[str, Any]) -> None:
        # the resource monitor prints its warnings itself, when they happen (from any thread, console or not)
        if info.get("message") and kind != "warning":  # the message as written: 'kiln[gpu]' is no markup
            self.console.print(f"[bold yellow]{kind}[/] {escape(str(info['message']))}", highlight=False)

    def on_train_end(self, trainer, metrics: dict[str, Any]) -> None:
        if self.progress:
            self.progress.stop()
            self.progress = None

    def on_run_end(self, trainer, status: str) -> None:
        self.on_train_end(trainer, {})  # a stopped run leaves its bar where it stopped


class JsonlSink(Sink):
    """Appends one JSON object per event to `path` (metrics.jsonl in the run directory), each with its
    `event` and `time` (Unix seconds): `train` (a logging step's metrics), `eval`, the notices (`rollback`,
    `warning`, ...), and around each process's share of the run a `start` (its `time`: when this sink was
    made, as the process set the run up; `step`: where it started) and an `end` (its `status`: finished,
    stopped or failed). A process that died without its `end` (killed, out of memory, power lost) gets one
    from the next start, with `status` killed and the time and step of the last record it wrote. `kiln runs`
    adds up the spans from each start to its end: the run's wall time without the pauses between them.

    A resumed run replays the steps after its checkpoint: the first write of a process drops the
    records those steps left behind (and a line cut short by a kill), so each step appears once.
    """

    name = "metrics.jsonl"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.started = time.time()
        self.file = None
        self.began = False  # this process has written its `start` record

    def _drop_replayed(self, step: int, kind: str | None) -> None:
        if not self.path.is_file():
            return
        keep, last, began = [], None, False  # last: the latest (time, step) of the process before this one
        for line in self.path.read_text(errors="replace").splitlines():  # a damaged byte costs its line alone
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):  # a line of damage that happens to parse (a number)
                continue
            event, s, t = rec.get("event"), rec.get("step", -1), rec.get("time")
            s = s if isinstance(s, int | float) else -1
            began |= event == "start"
            if event in ("start", "end"):
                last = (t, s) if event == "start" else None
            elif isinstance(t, int | float) and last is not None and (last[0] is None or t >= last[0]):
                last = (t, s)
            if event in ("start", "end") or s < step or (s == step and event != kind):  # an eval at `step`
                keep.append(line)  # is written again
        if began and last is not None:  # the process before ended without its `end` record
            keep.append(json.dumps({"event": "end", "time": last[0], "step": last[1], "status": "killed"}))
        atomic_write(self.path, "".join(f"{line}\n" for line in keep))

    def _open(self, trainer, kind: str | None) -> None:
        if not self.began:  # first event of this process: trainer.step is where it (re)started
            self._drop_replayed(trainer.step, kind)
            self.file = open(self.path, "a")
            self.began = True
            self.file.write(json.dumps({"event": "start", "time": self.started, "step": trainer.step}) + "\n")
        elif self.file is None:
            self.file = open(self.path, "a")

    def on_train_start(self, trainer) -> None:
        self._open(trainer, None)

    def _write(self, trainer, kind: str, metrics: dict[str, Any]) -> None:
        self._open(trainer, kind)
        self.file.write(json.dumps({"event": kind, "time": time.time(), **metrics}) + "\n")
        self.file.flush()

    def on_step_end(self, trainer, metrics) -> None:
        if metrics:
            self._write(trainer, "train", metrics)

    def on_eval_end(self, trainer, metrics) -> None:
        self._write(trainer, "eval", metrics)

    def on_notice(self, trainer, kind: str, info: dict[str, Any]) -> None:
        self._open(trainer, None)
        if kind == "rollback":  # the steps after the restored one are trained again: their records go
            self.file.close()
            keep = [line for line in self.path.read_text().splitlines() if _kept(line, trainer.step)]
            atomic_write(self.path, "".join(f"{line}\n" for line in keep))
            self.file = open(self.path, "a")
        self._write(trainer, kind, {"step": trainer.step, **info})

    def on_train_end(self, trainer, metrics) -> None:
        if self.file:
            self.file.close()
            self.file = None

    def on_run_end(self, trainer, status: str) -> None:
        if self.began:  # this process wrote to the run: its share of the run ends here
            self._write(trainer, "end", {"step": getattr(trainer, "step", None), "status": status})
        self.on_train_end(trainer, {})


def _kept(line: str, step: int) -> bool:
    """Whether a metrics.jsonl record stays after a rollback to `step`: notices and records up to it do."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return False
    return rec.get("event") not in ("train", "eval") or rec.get("step", -1) <= step


def enabled_sinks(cfg, run_dir: Path, log) -> list[Sink]:
    """The sinks of external tools that `cfg.logging` turns on, for rank 0 (the console and metrics.jsonl
    are made by the caller). A missing package is a ConfigError naming the extra, raised here, before any
    training; a tool that cannot be reached fails later, in the sink's first event, and is only disabled."""
    lcfg, out = cfg.logging, []
    if lcfg.tensorboard:
        from kiln.monitor.sinks.tensorboard import TensorBoardSink

        out.append(TensorBoardSink(cfg, run_dir))
    if lcfg.wandb:
        from kiln.monitor.sinks.wandb_sink import WandbSink

        out.append(WandbSink(cfg, run_dir, log))
    if lcfg.mlflow:
        from kiln.monitor.sinks.mlflow_sink import MlflowSink

        out.append(MlflowSink(cfg, run_dir, log))
    if lcfg.prometheus_port is not None:
        from kiln.monitor.sinks.prometheus import PrometheusSink

        out.append(PrometheusSink(cfg, run_dir, log))
    return out
