"""train.log in the run directory: the run's progress as plain lines, whatever the console shows (logging.console
off, a terminal's progress bar, output nobody kept), for `tail -f` and for reading after the fact.

    2026-11-27 17:30:02  start at step 0 of 400
    2026-11-27 17:30:09  step 10/400 (2%)  loss 5.9912  lr 1.00e-04  2,530 tok/s  eta 4m31s  mem host 0.42 GiB
    2026-11-27 17:30:40  eval step 100: val_loss 4.1234  val_ppl 61.79
    2026-11-27 17:31:12  rollback: step 137 went bad (loss spike ...): rolled back to step 130
    2026-11-27 17:35:10  end at step 400: finished

Each process that works on the run appends its share (a resume starts with its `start` line), one line per
logging step (kiln.monitor.progress), each flushed as written.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kiln.events import Sink
from kiln.monitor.progress import ProgressLines

NAME = "train.log"


class LogFileSink(Sink):
    """Appends the run's progress to `path` (train.log in the run directory), a time stamp on each line."""

    name = NAME

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = None
        self.lines: ProgressLines | None = None

    def _write(self, text: str) -> None:
        if self.file is None:
            self.file = open(self.path, "a")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.file.write("".join(f"{stamp}  {line}\n" for line in text.splitlines() or [""]))
        self.file.flush()

    def _begin(self, trainer) -> None:
        """This process's first line: where it starts (the evaluation before the first step comes after it)."""
        if self.lines is None:
            self.lines = ProgressLines(self._write, trainer.cfg.train.max_steps)
            self._write(f"start at step {trainer.step} of {self.lines.total}")

    def on_train_start(self, trainer) -> None:
        self._begin(trainer)
        self.lines.begin(trainer.step)

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if metrics:
            self._begin(trainer)
            self.lines(trainer.step, metrics)

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        self._begin(trainer)
        extra = f"  val_bpb {metrics['val_bpb']:.4f}" if "val_bpb" in metrics else ""
        self._write(f"eval step {metrics['step']}: val_loss {metrics['val_loss']:.4f}  "
                    f"val_ppl {metrics['val_ppl']:.2f}{extra}")

    def on_notice(self, trainer, kind: str, info: dict[str, Any]) -> None:
        self._begin(trainer)
        self._write(f"{kind}: {info['message']}" if info.get("message") else f"{kind}: {info}")

    def on_run_end(self, trainer, status: str) -> None:
        if self.lines is None:  # nothing of this process reached the run: nothing to say
            return
        self._write(f"end at step {getattr(trainer, 'step', '?')}: {status}")
        self.file.close()
        self.file = None
