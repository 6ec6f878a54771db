"""Early stopping on validation loss, a callback of the training loop (train.early_stop).

An evaluation improves when its val_loss is below the best so far by more than `min_delta`. After
`patience` evaluations in a row without improvement the callback sets `trainer.stop_reason`: the loop
ends after that step, the final checkpoint and model are saved as at the end of any run, and the
reason is printed and written to metrics.jsonl as an `early_stop` event. Its state (best loss, its
step, evaluations since) is saved in checkpoints under the trainer's key "early_stop", so a resumed
run counts on; resuming a run that stopped early stops it again at once, unless the config now allows
more patience (or turns early stopping off with patience 0).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.events import Callback


class EarlyStop(Callback):
    state_key = "early_stop"

    def __init__(self, patience: int, min_delta: float = 0.0, log: Callable[[str], None] | None = print,
                 metrics_path: Path | None = None):
        self.patience, self.min_delta, self.log, self.metrics_path = patience, min_delta, log, metrics_path
        self.best: float | None = None
        self.best_step: int | None = None
        self.since = 0  # evaluations since the best one
        self.last_step = -1  # the step of the last evaluation counted (a resume may evaluate a step again)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "since": self.since, "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.since, self.last_step = int(state.get("since", 0)), int(state.get("last_step", -1))

    def reason(self) -> str:
        return (f"validation loss has not improved by more than {self.min_delta:g} for {self.since} evaluations "
                f"(train.early_stop.patience={self.patience}); best {self.best:.4f} at step {self.best_step}")

    def on_train_start(self, trainer) -> None:
        if self.since >= self.patience and trainer.step < trainer.cfg.train.max_steps:  # resumed after a stop
            self._stop(trainer, again=True)

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        step, loss = metrics.get("step", trainer.step), metrics.get("val_loss")
        if loss is None or step <= self.last_step:
            return
        self.last_step = step
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.best_step, self.since = loss, step, 0
            return
        self.since += 1
        if self.since >= self.patience and step < trainer.cfg.train.max_steps and trainer.stop_reason is None:
            self._stop(trainer)

    def _stop(self, trainer, again: bool = False) -> None:
        trainer.stop_reason = "early stop: " + self.reason()
        if self.log is not None:
            self.log(f"stopping early at step {trainer.step}{' (again, as before the resume)' if again else ''}: "
                     f"{self.reason()}")
        if self.metrics_path is not None and not again:
            record = {"event": "early_stop", "time": time.time(), "step": trainer.step, "reason": self.reason(),
                      "best_val_loss": self.best, "best_step": self.best_step}
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
