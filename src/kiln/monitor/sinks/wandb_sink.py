"""Weights & Biases: the config, the metrics, the samples and, at the end, the run directory's files.

The W&B run id is kept in <run_dir>/wandb_id.txt, so a resumed Kiln run continues the same W&B run.
Offline mode (logging.wandb_mode=offline) writes under <run_dir>/wandb/, for `wandb sync` later.

W&B refuses a `log(step=...)` below the last step it has, which a resumed run (its checkpoint older than
its last logged step) and a rollback (kiln.train.rollback) both send: the steps they train again would be
lost. So W&B keeps its own step (`_step`, one more per row) and the optimizer step goes in each row as the
metric `step`, declared the x axis of every train/ and eval/ metric: the replayed steps are kept, beside
the first tries. (Rewinding the W&B run, `resume_from`, needs the W&B server's beta feature and a network.)
"""

from __future__ import annotations

import secrets
import shutil
import string
from collections.abc import Callable
from pathlib import Path

from kiln.monitor.sinks.base import MetricSink, require, run_files

ID_FILE = "wandb_id.txt"
STEP = "step"  # the x axis of the charts: the optimizer step, which a resume or rollback may take back


class WandbSink(MetricSink):
    """Logs with the `wandb` package (extra: wandb). Metrics are 'train/<metric>' and 'eval/<metric>',
    charted against the metric 'step' (the optimizer step), so the steps a resume or rollback replays stay."""

    name = "wandb"

    def __init__(self, cfg, run_dir: Path, log: Callable[[str], None] = print):
        super().__init__()
        self.wandb = require("wandb", "wandb", "logging.wandb")
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        self.run = None

    def run_id(self) -> str:
        """This run directory's W&B id: the one saved by an earlier process, else a new one (saved)."""
        path = self.run_dir / ID_FILE
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as W&B's ids
        path.write_text(new + "\n")
        return new

    def open(self, trainer) -> None:
        lcfg = self.cfg.logging
        tags = [f"{k}:{v}" for k, v in lcfg.tags.items()]
        self.run = self.wandb.init(
            project=lcfg.wandb_project, entity=lcfg.wandb_entity, name=lcfg.wandb_name or self.run_dir.name,
            id=self.run_id(), resume="allow", dir=str(self.run_dir), mode=lcfg.wandb_mode, tags=tags or None,
            config=self.cfg.model_dump(mode="json"), allow_val_change=True)  # a resume may change max_steps
        self.run.define_metric(STEP)
        for kind in ("train", "eval"):
            self.run.define_metric(f"{kind}/*", step_metric=STEP)
        self.log(f"W&B run {self.run.id} ({lcfg.wandb_mode})" + (f": {self.run.url}" if self.run.url else ""))

    def write(self, step: int, values: dict[str, float], kind: str) -> None:
        self.run.log({STEP: step, **{f"{kind}/{k}": v for k, v in values.items()}})  # W&B's _step: one more

    def sample(self, step: int, text: str) -> None:
        self.run.summary["sample"] = text

    def close(self, status: str) -> None:
        for path in run_files(self.run_dir):  # copied as they are now into W&B's files, then uploaded
            copy = Path(self.run.dir) / path.name
            shutil.copy2(path, copy)
            self.run.save(str(copy), base_path=self.run.dir, policy="now", glob=False)
        if status == "stopped":
            self.run.mark_preempting()  # W&B shows it as preempted, to be resumed
        self.run.finish(exit_code=0 if status == "finished" else 1)
