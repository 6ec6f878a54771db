"""TensorBoard: a scalar for every metric, the resolved config, the samples and the run's events (rollbacks,
early stops, warnings, automatic batch choices, out-of-memory retries: `events/<kind>`) as text, in
<run_dir>/tensorboard. At the run's end, TensorBoard's HParams dashboard gets the config (its scalar settings,
dotted: train.lr) with the final train/loss and eval/ metrics, so runs compare in one table.

Steps trained again are shown once: a resume, and a rollback, open a new event file that begins with
TensorBoard's purge mark (`purge_step`), so its readers drop what the earlier files hold from that step on."""

from __future__ import annotations

import math
from pathlib import Path

from kiln.monitor.sinks.base import MetricSink, flatten, require


class TensorBoardSink(MetricSink):
    """Writes event files with torch's SummaryWriter (extra: tensorboard). Tags are 'train/<metric>' and
    'eval/<metric>'. A resumed run purges what its replayed steps had written after the checkpoint."""

    name = "tensorboard"

    def __init__(self, cfg, run_dir: Path):
        super().__init__()
        require("tensorboard", "tensorboard", "logging.tensorboard")
        self.cfg, self.dir = cfg, Path(run_dir) / "tensorboard"
        self.writer = None
        self.final: dict[str, float] = {}  # the latest value of each train/ and eval/ scalar: the HParams metrics

    def open(self, trainer) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resume: TensorBoard drops what the earlier process wrote after the checkpoint, which is replayed
        self.writer = SummaryWriter(str(self.dir), purge_step=trainer.step + 1 if trainer.step else None,
                                    flush_secs=30)
        self.make_writer = lambda purge: SummaryWriter(str(self.dir), purge_step=purge, flush_secs=30)
        text = "    " + self.cfg.to_yaml().replace("\n", "\n    ")  # indented: markdown shows it verbatim
        self.writer.add_text("config", text, trainer.step)

    def write(self, step: int, values: dict[str, float], kind: str) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)
            if kind == "eval" or k == "loss":
                self.final[f"{kind}/{k}"] = v
        if kind == "eval":
            self.writer.flush()

    def event(self, step: int, kind: str, text: str, info: dict) -> None:
        if kind == "rollback":  # the steps after the restored one are trained again: the earlier tries go
            step = int(info.get("to_step", step))
            self.writer.close()
            self.writer = self.make_writer(step + 1)
        self.writer.add_text(f"events/{kind}", text, step)
        self.writer.flush()

    draws_histograms = True

    def histograms(self, step: int, weights: dict, grad_norms: dict[str, float]) -> None:
        for name, values in weights.items():
            self.writer.add_histogram(f"weights/{name}", values, step)
        if grad_norms:
            import torch

            self.writer.add_histogram("grad_norms", torch.tensor(list(grad_norms.values())), step)

    def sample(self, step: int, text: str) -> None:
        self.writer.add_text("sample", "    " + text.replace("\n", "\n    "), step)

    def close(self, status: str) -> None:
        self._hparams()
        self.writer.close()

    def _hparams(self) -> None:
        """The config and the final metrics for the HParams dashboard (its metrics are scalar tags of this
        run, train/loss and eval/*, which it reads from the event files)."""
        from torch.utils.tensorboard.summary import hparams


        config = {}
        for k, v in flatten(self.cfg.model_dump(mode="json")).items():
            config[k] = v  # flatten gives text: numbers become numbers again (the dashboard sorts them)
            try:
                config[k] = float(v) if v not in ("True", "False", "None") else v
            except ValueError:
                pass
        experiment, start, end = hparams(config, {k: v for k, v in self.final.items() if math.isfinite(v)})
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)
