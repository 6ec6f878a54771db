"""MLflow: the flattened config as params, the metrics by step, tags, the samples, and at the end the
final model directory and the run's files as artifacts.

Any tracking URI works (a server, Databricks, a database). The default is local: a SQLite store
<run_dir>/mlflow.db with artifacts in <run_dir>/mlartifacts (`mlflow ui --backend-store-uri
sqlite:///<run_dir>/mlflow.db` shows it). The MLflow run id is kept in <run_dir>/mlflow_run_id.txt, so
a resumed Kiln run continues the same MLflow run.

A resume (from a checkpoint older than the last logged step) and a rollback (kiln.train.rollback) train
steps again. MLflow keeps every value logged at a step and cannot delete one, so logging them again under
their own names would draw each chart back and forth over those steps. A step at or below the highest one
this MLflow run already has for its kind (train or eval) is logged under the prefix `replay/` instead
(`replay/train/loss`): `train/loss` keeps one value per step, the first, and the values of the steps trained
again are kept beside it, as the W&B sink keeps them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from kiln.errors import ResourceError
from kiln.monitor.sinks.base import MetricSink, finite, flatten, require, run_files

ID_FILE = "mlflow_run_id.txt"
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
REPLAY = "replay"  # the prefix of the metrics of a step logged again (replay/train/loss)


def metric_key(key: str) -> str:
    """`key` with the characters MLflow refuses in a metric name (all but letters, digits and _-. :/) as '_'."""
    return re.sub(r"[^\w\-. :/]", "_", key, flags=re.ASCII)


class MlflowSink(MetricSink):
    """Logs with MlflowClient (extra: mlflow). Metrics are sent in batches without waiting for the
    server (MLflow's asynchronous logging); the end of the run waits for them."""

    name = "mlflow"

    def __init__(self, cfg, run_dir: Path, log: Callable[[str], None] = print):
        super().__init__()
        self.mlflow = require("mlflow", "mlflow", "logging.mlflow")
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        self.client = self.run_id = None
        self.pending: list = []  # asynchronous logging operations not yet waited for
        self.highest: dict[str, int] = {}  # the highest step of each kind (train, eval) this MLflow run has

    def tracking_uri(self) -> str:
        return self.cfg.logging.mlflow_tracking_uri or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"

    def open(self, trainer) -> None:
        uri = self.tracking_uri()
        try:
            self._open(uri, trainer.step)
        except Exception as e:  # a store that cannot be written or reached: say which one and where it is set
            where = "logging.mlflow_tracking_uri" if self.cfg.logging.mlflow_tracking_uri else "the default store"
            raise ResourceError(f"MLflow tracking URI {uri} ({where}) cannot be used ({type(e).__name__}: {e}); "
                                "check it (a server, a database, a writable directory) or turn logging.mlflow "
                                "off") from e

    def _open(self, uri: str, step: int = 0) -> None:
        from mlflow.entities import Param, RunTag

        lcfg = self.cfg.logging
        self.client = self.mlflow.tracking.MlflowClient(uri)
        exp = self.client.get_experiment_by_name(lcfg.mlflow_experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            exp_id = self.client.create_experiment(lcfg.mlflow_experiment, artifact_location=self.artifact_location())
        run = self._saved_run(exp_id)
        tags = {"kiln.run_dir": str(self.run_dir.resolve()), "mlflow.source.name": "kiln", **lcfg.tags}
        if run is None:
            run = self.client.create_run(exp_id, run_name=self.run_dir.name, tags=tags)
            (self.run_dir / ID_FILE).write_text(run.info.run_id + "\n")
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self.highest = self._highest(run)
        params, changed = self._params(run.data.params, step)
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params[i:i + 100]])
        if changed:
            tags["kiln.config_changes"] = f"at step {step}: " + "; ".join(changed)
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        self.log(f"MLflow run {self.run_id} in experiment '{lcfg.mlflow_experiment}' at {uri}")

    def artifact_location(self) -> str | None:
        """Where a new experiment keeps its artifacts. The default store: <run_dir>/mlartifacts; another SQLite
        database: mlartifacts beside it; a server (http, databricks) or a file store: None, its own artifact
        store. MLflow's default for a database without a server is ./mlruns of the current directory, which
        would scatter artifacts over the places runs are launched from: another database gets
        <run_dir>/mlartifacts."""
        uri = self.cfg.logging.mlflow_tracking_uri
        if not uri:
            return (self.run_dir / "mlartifacts").resolve().as_uri()
        scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
        if scheme == "sqlite":
            db = uri.split("://", 1)[1]  # sqlite:///relative.db or sqlite:////absolute.db
            db = db[1:] if db.startswith("/") else db
            return (Path(db).expanduser().resolve().parent / "mlartifacts").as_uri() if db else None
        if scheme in ("postgresql", "mysql", "mssql"):
            return (self.run_dir / "mlartifacts").resolve().as_uri()
        return None

    def _params(self, known: dict[str, str], step: int) -> tuple[list[tuple[str, str]], list[str]]:
        """(params to log, the changes they record). MLflow never changes a param's value, so a value that a
        resume (`--resume force`) changed is logged as '<key>/from_step_<step>', beside the first one, and the
        changes are kept in the tag kiln.config_changes (tags can change)."""
        out, changed = [], []
        for k, v in flatten(self.cfg.model_dump(mode="json")).items():
            if k not in known:
                out.append((k, v))
                continue
            latest = max((p for p in known if p.startswith(f"{k}/from_step_")),
                         key=lambda p: int(p.rsplit("_", 1)[1]), default=k)
            if known[latest] != v:
                if f"{k}/from_step_{step}" not in known:  # (a second change at the same step: in the tag only)
                    out.append((f"{k}/from_step_{step}", v))
                changed.append(f"{k} {known[latest]} -> {v}")
        return out, changed

    def _saved_run(self, exp_id: str):
        """The MLflow run an earlier process of this run directory made, if the store still has it."""
        path = self.run_dir / ID_FILE
        if not path.is_file():
            return None
        try:
            run = self.client.get_run(path.read_text().strip())
        except self.mlflow.exceptions.MlflowException:
            return None
        return run if run.info.experiment_id == exp_id else None

    def _highest(self, run) -> dict[str, int]:
        """The highest step of each kind (train, eval) among the run's metrics: MLflow's latest value of a
        metric is the one at its highest step."""
        latest = getattr(run.data, "_metric_objs", None)  # what get_run read: each metric's latest value
        if latest is None:  # another MLflow's RunData: the metrics' histories
            latest = [m for key in run.data.metrics for m in self.client.get_metric_history(run.info.run_id, key)]
        out: dict[str, int] = {}
        for m in latest:
            kind = m.key.split("/", 1)[0]
            if kind in ("train", "eval"):
                out[kind] = max(out.get(kind, -1), m.step)
        return out

    def write(self, step: int, values: dict[str, float], kind: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        prefix = kind if step > self.highest.get(kind, -1) else f"{REPLAY}/{kind}"  # a step trained again
        self.highest[kind] = max(self.highest.get(kind, -1), step)
        metrics = [Metric(metric_key(f"{prefix}/{k}"), v, now, step) for k, v in finite(values).items()]
        self.pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        self._reap()

    def _reap(self) -> None:
        """Wait for the operations already done (raising their errors) and keep the others."""
        keep = []
        for op in self.pending:
            futures = getattr(op, "_operation_futures", None)
            if futures is not None and all(f.done() for f in futures):
                op.wait()
            else:
                keep.append(op)
        self.pending = keep

    def event(self, step: int, kind: str, text: str, info: dict) -> None:
        """The metric events/<kind> = 1 at the step (a mark on the charts) and the tag kiln.event.<kind>, the
        latest of its kind in words."""
        from mlflow.entities import Metric, RunTag

        mark = Metric(metric_key(f"events/{kind}"), 1.0, int(time.time() * 1000), step)
        tag = RunTag(f"kiln.event.{metric_key(kind)}", f"step {step}: {text}"[:5000])
        self.client.log_batch(self.run_id, metrics=[mark], tags=[tag])  # in order: the tag is the latest event

    def sample(self, step: int, text: str) -> None:
        self.client.log_text(self.run_id, text, f"samples/step_{step}.txt")

    def close(self, status: str) -> None:
        for op in self.pending:
            op.wait()
        self.pending = []
        model = self.run_dir / "model"
        if status == "finished" and self.cfg.logging.log_model and model.is_dir():
            self.client.log_artifacts(self.run_id, str(model), "model")
            if self.cfg.logging.mlflow_register:  # a new version in the model registry, with its lineage
                from kiln.monitor.sinks.mlflow_registry import register

                register(self.client, self.run_id, self.cfg.logging.mlflow_register, self.run_dir, self.cfg, self.log)
        for path in run_files(self.run_dir):
            if not path.name.startswith("mlflow.db"):  # the store itself (and its journal)
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, STATUS[status])
