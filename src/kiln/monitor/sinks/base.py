"""What the sinks of external tools share: importing their optional package, and turning the trainer's
events into (step, {name: number}) records."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.events import Sink


def require(module: str, extra: str, setting: str) -> Any:
    """Import `module` (the optional package behind `setting`), or raise a ConfigError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{setting} needs the package '{module.split('.')[0]}', which is not installed "
                          f"({e}). Install it with: pip install 'kiln[{extra}]' (or turn {setting} off)") from None


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric values of `metrics` as floats, without the step (the x axis) and the event kind."""
    out = {}
    for k, v in metrics.items():
        if k in ("step", "event") or not isinstance(v, int | float):
            continue
        out[k] = float(v)
    return out


def finite(values: dict[str, float]) -> dict[str, float]:
    """`values` without NaN and infinities (some tools refuse them)."""
    return {k: v for k, v in values.items() if math.isfinite(v)}


def run_files(run_dir: Path, limit: int = 100 << 20) -> list[Path]:
    """The run directory's own files (config.yaml, metrics.jsonl, plots, ids): regular files at its top
    level under `limit` bytes; checkpoints/, model/ and the tools' folders are left out."""
    return sorted(p for p in Path(run_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.stat().st_size <= limit)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 0.1}} -> {"train.lr": "0.1"}: the config as MLflow params (values cut to 6000 chars)."""
    out: dict[str, str] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


def event_text(kind: str, info: dict[str, Any]) -> str:
    """One line about a notice (a rollback, an early stop, a warning, an automatic batch choice, an
    out-of-memory retry): its message, else its kind and data."""
    if info.get("message"):
        return str(info["message"])
    return kind.replace("_", " ") + ": " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "step")


class MetricSink(Sink):
    """A sink of numbers. `open(trainer)` runs at its first event (the evaluation before training comes
    before `on_train_start`); `write(step, values, kind)` gets each logging step's train metrics (kind
    'train') and each evaluation's ('eval'); `sample(step, text)` each generated text; `event(step, kind,
    text, info)` each notice (`kind`: rollback, early_stop, warning, auto_batch, oom, ...; `text`: one line
    for people); `close(status)` runs once at the end of the run, whatever ended it."""

    def __init__(self):
        self.opened = self.closed = False

    def open(self, trainer) -> None: ...

    def write(self, step: int, values: dict[str, float], kind: str) -> None: ...

    def sample(self, step: int, text: str) -> None: ...

    def event(self, step: int, kind: str, text: str, info: dict[str, Any]) -> None: ...

    def histograms(self, step: int, weights: dict[str, Any], grad_norms: dict[str, float]) -> None:
        """Called every logging.histograms_every steps, by the sinks that define it (`draws_histograms`)."""

    draws_histograms = False
    tap = None

    def close(self, status: str) -> None: ...

    def _ensure_open(self, trainer) -> None:
        if not self.opened:
            self.opened = True
            self.open(trainer)

    def on_train_start(self, trainer) -> None:
        self._ensure_open(trainer)
        every = getattr(getattr(trainer.cfg, "logging", None), "histograms_every", 0)
        if self.draws_histograms and every and getattr(trainer, "optimizer", None) is not None:
            from kiln.monitor.sinks.histograms import ParamTap

            self.tap = ParamTap(every)
            self.tap.attach(trainer)

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if metrics:
            self._ensure_open(trainer)
            self.write(int(metrics.get("step", trainer.step)), numbers(metrics), "train")
        if self.tap is not None and self.tap.due(trainer.step):
            self.histograms(trainer.step, self.tap.weights(), self.tap.grad_norms if self.tap.at == trainer.step
                            else {})

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        self._ensure_open(trainer)
        self.write(int(metrics.get("step", trainer.step)), numbers(metrics), "eval")

    def on_notice(self, trainer, kind: str, info: dict[str, Any]) -> None:
        self._ensure_open(trainer)
        step = info.get("step", trainer.step)
        self.event(int(step) if isinstance(step, int | float) else trainer.step, kind, event_text(kind, info), info)

    def on_sample(self, trainer, text: str) -> None:
        self._ensure_open(trainer)
        self.sample(trainer.step, text)

    def on_run_end(self, trainer, status: str) -> None:
        if self.tap is not None:
            self.tap.detach()
        if self.opened and not self.closed:
            self.closed = True
            self.close(status)
