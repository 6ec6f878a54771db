"""`logging:` where a run's metrics go (console, files, dashboards)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.config.base import Problem, Section


class LoggingConfig(Section):
    every: int = Field(10, ge=1)
    """Read the loss back from the device and log every N steps."""
    console: bool = True
    """Show a progress bar and log lines on the console."""
    jsonl: bool = True
    """Write metrics to metrics.jsonl in the run directory."""
    log_file: bool = True
    """Append the run's progress to train.log in the run directory, whatever the console shows: a time-stamped line
    per logging step (step, loss, lr, tokens/s, ETA, memory), each evaluation and notice, and each start and end."""
    plots: bool = True
    """At the end of a run, draw plots.png from metrics.jsonl (needs matplotlib: pip install 'kiln[plot]')."""
    tensorboard: bool = False
    """Write every metric, the config and the samples for TensorBoard to <run_dir>/tensorboard (extra: tensorboard)."""
    wandb: bool = False
    """Log the config, the metrics, the samples and at the end the run's files to Weights & Biases (extra: wandb)."""
    wandb_project: str = "kiln"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B team or user that owns the project (null: your default entity)."""
    wandb_name: str | None = None
    """Name of the run in W&B (null: the run directory's name)."""
    wandb_group: str | None = None
    """W&B group of the run (runs of one experiment or sweep shown together; null: none)."""
    wandb_job_type: str | None = "train"
    """W&B job type of the run (W&B filters and groups by it; null: none)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """'online' sends to the W&B server as the run goes; 'offline' writes <run_dir>/wandb/ for `wandb sync` later."""
    mlflow: bool = False
    """Log the config as params, the metrics, tags, the samples and the final model to MLflow (extra: mlflow)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (a server, databricks, a database); null: a local store, <run_dir>/mlflow.db."""
    mlflow_experiment: str = "kiln"
    """MLflow experiment the run is recorded in (made if missing)."""
    mlflow_register: str | None = None
    """Register the final model (its Hugging Face export, with its lineage: data manifest hashes, config, final
    metrics) as a new version of this registered model in MLflow's model registry (needs logging.mlflow)."""
    histograms_every: int = Field(0, ge=0)
    """Every N steps, histograms of each weight and of the per-parameter gradient norms to TensorBoard and W&B
    (0: off; each copies every weight to the host)."""
    log_model: bool = True
    """At the end of a finished run, upload the final model/ to W&B (an artifact of type 'model', aliases
    latest and step-N) and MLflow (artifacts under model/); false: only metrics, config and small files."""
    tags: dict[str, str] = {}
    """Tags of the run: MLflow tags as given, W&B tags as 'key:value'."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Serve the latest metrics at http://HOST:PORT/metrics for Prometheus on rank 0 (0: a free port, logged;
    null: off; extra: prometheus)."""
    prometheus_addr: str = "0.0.0.0"
    """Address the Prometheus endpoint listens on ('127.0.0.1': this machine only)."""

    def problems(self) -> list[Problem]:
        if self.mlflow_register and not self.mlflow:
            return [(("mlflow_register", "mlflow"), f"logging.mlflow_register={self.mlflow_register} registers the "
                     "model MLflow's sink logs: set logging.mlflow=true too")]
        return []
