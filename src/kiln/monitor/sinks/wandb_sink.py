"""Weights & Biases: the config, the metrics, the samples and, at the end, the run directory's files.

The W&B run id is kept in <run_dir>/wandb_id.txt, so a resumed Kiln run continues the same W&B run.
Offline mode (logging.wandb_mode=offline) writes under <run_dir>/wandb/, for `wandb sync` later.

W&B refuses a `log(step=...)` below the last step it has, which a resumed run (its checkpoint older than
its last logged step) and a rollback (kiln.train.rollback) both send: the steps they train again would be
lost. So W&B keeps its own step (`_step`, one more per row) and the optimizer step goes in each row as the
metric `step`, declared the x axis of every train/ and eval/ metric: the replayed steps are kept, beside
the first tries. (Rewinding the W&B run, `resume_from`, needs the W&B server's beta feature and a network.)

Online, the sink first connects to W&B's server (PROBE_S seconds at most): a name that does not resolve or a
server that does not take the connection is logged offline at once. Then W&B gets INIT_TIMEOUT_S seconds to
start the run (WANDB_INIT_TIMEOUT sets another), not its own 90 s of retries. Either way, without a network
or an API key, the sink says why and logs offline instead, into the same run id (`wandb sync` uploads it
later), and training goes on. W&B's own console lines are
quieted (the sink prints the run's URL): the account lookups it makes for them wait 5 s each without a
network. WANDB_MODE=offline in the environment logs offline whatever logging.wandb_mode says.

Offline, W&B writes what it was given to the run's .wandb file every FLUSH_S seconds (its own default is 15 s,
and a process killed before that left a 7-byte file), and a resumed run continues the same offline run
through kiln.monitor.sinks.wandb_offline: the newest offline folder holds every process's history.
"""

from __future__ import annotations

import os
import secrets
import shutil
import string
from collections.abc import Callable
from pathlib import Path

from kiln.monitor.sinks.base import MetricSink, require, run_files
from kiln.state.rundir import model_saved

ID_FILE = "wandb_id.txt"
STEP = "step"  # the x axis of the charts: the optimizer step, which a resume or rollback may take back
INIT_TIMEOUT_S = 20.0  # how long an online run may take to start before the sink logs offline instead
ALERTS = {"rollback", "early_stop", "oom", "oom_stop", "warning", "data_shift"}  # events sent as W&B alerts online
PROBE_S = 3.0  # how long a connection to W&B's server may take before the sink logs offline at once
FLUSH_S = 2.0  # how often W&B writes what it was given to the run's .wandb file (what a killed process keeps)


class WandbSink(MetricSink):
    """Logs with the `wandb` package (extra: wandb). Metrics are 'train/<metric>' and 'eval/<metric>',
    charted against the metric 'step' (the optimizer step), so the steps a resume or rollback replays stay."""

    name = "wandb"

    def __init__(self, cfg, run_dir: Path, log: Callable[[str], None] = print):
        super().__init__()
        self.wandb = require("wandb", "wandb", "logging.wandb")
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        self.run = self.mode = None
        self.step = 0  # the latest train step logged: the model artifact's
        self.predecessors: list[Path] = []  # offline folders of earlier processes whose history this one logged
        self.replayed = 0

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
        mode = "offline" if os.environ.get("WANDB_MODE") in ("offline", "dryrun") else lcfg.wandb_mode
        if mode == "online":
            try:
                unreachable = self._unreachable()
                if unreachable:
                    raise ConnectionError(unreachable)
                self.run = self._init("online")
            except Exception as e:  # no network, no API key, a server that does not answer in time
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.log(f"W&B could not start the online run ({type(e).__name__}: {why}); logging offline to "
                         f"{self.run_dir / 'wandb'} instead: upload it later with `wandb sync "
                         f"{self.run_dir / 'wandb'}/offline-run-*`. An online run gets {self._timeout():g} s to start "
                         "(WANDB_INIT_TIMEOUT); logging.wandb_mode=offline goes offline at once")
                mode = "offline"
                self.wandb.teardown()  # W&B's service holds the failed run's id: a new service starts offline
        if mode == "offline":
            self.run = self._init("offline")
        self.run.define_metric(STEP)
        for kind in ("train", "eval", "events", "weights", "grad_norms"):
            self.run.define_metric(f"{kind}/*", step_metric=STEP)
        self.mode = mode
        if mode == "offline":
            self._continue_offline()
        self.log(f"W&B run {self.run.id} ({mode})" + (f": {self.run.url}" if self.run.url else ""))

    def _continue_offline(self) -> None:
        """Log again the history of the earlier processes' offline folders of this run (wandb_offline)."""
        from kiln.monitor.sinks import wandb_offline

        folder = Path(self.run.dir).parent  # wandb/offline-run-<time>-<id>; run.dir is its files/
        history, self.predecessors = wandb_offline.resolved_history(folder.parent, self.run.id, exclude=folder)
        if history:
            wandb_offline.mark_replaying(folder, len(history))
            for row in history:
                self.run.log(row)
            self.replayed = len(history)

    @staticmethod
    def _unreachable() -> str | None:
        """Why W&B's server cannot be reached from here (its name does not resolve, nothing answers a
        connection within PROBE_S seconds), or None: found before W&B spends INIT_TIMEOUT_S retrying."""
        import socket
        from urllib.parse import urlparse

        url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
        host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
        if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or os.environ.get("HTTP_PROXY"):
            return None  # through a proxy: W&B's own attempt decides
        try:
            with socket.create_connection((host, port), timeout=PROBE_S):
                return None
        except socket.gaierror as e:
            return f"{host} does not resolve ({e.strerror or e}): no network or no DNS here"
        except OSError as e:
            return f"{host}:{port} cannot be reached ({e.strerror or type(e).__name__})"

    @staticmethod
    def _timeout() -> float:
        """Seconds an online run may take to start: WANDB_INIT_TIMEOUT (W&B's own variable) if set, else ours."""
        try:
            return float(os.environ.get("WANDB_INIT_TIMEOUT") or INIT_TIMEOUT_S)
        except ValueError:
            return INIT_TIMEOUT_S

    def _init(self, mode: str):
        lcfg = self.cfg.logging
        tags = [f"{k}:{v}" for k, v in lcfg.tags.items()]
        settings = {"quiet": True}  # quiet: no account lookups for the "logged in as" line (5 s each offline)
        if "x_transaction_log_flush_interval" in getattr(self.wandb.Settings, "model_fields", {}):
            settings["x_transaction_log_flush_interval"] = FLUSH_S
        if mode == "online":
            settings["init_timeout"] = self._timeout()
        return self.wandb.init(
            project=lcfg.wandb_project, entity=lcfg.wandb_entity, name=lcfg.wandb_name or self.run_dir.name,
            id=self.run_id(), resume="allow", dir=str(self.run_dir), mode=mode, tags=tags or None,
            group=lcfg.wandb_group, job_type=lcfg.wandb_job_type,
            config=self.cfg.model_dump(mode="json"), allow_val_change=True,  # a resume may change max_steps
            settings=self.wandb.Settings(**settings))

    def write(self, step: int, values: dict[str, float], kind: str) -> None:
        self.step = max(self.step, step) if kind == "train" else self.step
        self.run.log({STEP: step, **{f"{kind}/{k}": v for k, v in values.items()}})  # W&B's _step: one more

    def event(self, step: int, kind: str, text: str, info: dict) -> None:
        """A row events/<kind> = 1 at the step (a mark on the charts), the latest of each kind in the summary,
        and online a W&B alert (an email or Slack message, as the user's W&B settings say)."""
        self.run.log({STEP: step, f"events/{kind}": 1})
        self.run.summary[f"events/{kind}"] = f"step {step}: {text}"
        if self.mode == "online" and kind in ALERTS:
            try:
                self.run.alert(title=f"{self.run.name}: {kind.replace('_', ' ')} at step {step}", text=text,
                               level=self.wandb.AlertLevel.WARN, wait_duration=0)
            except Exception as e:  # noqa: BLE001 - an alert W&B refuses (rate limit, no network) is not the run's
                self.log(f"W&B alert not sent ({type(e).__name__}: {e})")

    draws_histograms = True

    def histograms(self, step: int, weights: dict, grad_norms: dict[str, float]) -> None:
        row = {f"weights/{name}": self.wandb.Histogram(values.numpy()) for name, values in weights.items()}
        if grad_norms:
            row["grad_norms/per_parameter"] = self.wandb.Histogram(list(grad_norms.values()))
        self.run.log({STEP: step, **row})

    def sample(self, step: int, text: str) -> None:
        self.run.summary["sample"] = text

    def close(self, status: str) -> None:
        for path in run_files(self.run_dir):  # copied as they are now into W&B's files, then uploaded
            copy = Path(self.run.dir) / path.name
            shutil.copy2(path, copy)
            self.run.save(str(copy), base_path=self.run.dir, policy="now", glob=False)
        model = self.run_dir / "model"
        if status == "finished" and self.cfg.logging.log_model and model_saved(model):
            artifact = self.wandb.Artifact(f"{self.run.name or self.run.id}-model".replace("/", "-"), type="model",
                                           metadata={"step": self.step, "run_dir": str(self.run_dir.resolve())})
            artifact.add_dir(str(model))
            self.run.log_artifact(artifact, aliases=["latest", f"step-{self.step}"])
        if status == "stopped":
            self.run.mark_preempting()  # W&B shows it as preempted, to be resumed
        folder = Path(self.run.dir).parent
        offline = self.mode == "offline"
        self.run.finish(exit_code=0 if status == "finished" else 1)
        if offline and self.predecessors:
            from kiln.monitor.sinks import wandb_offline

            self.wandb.teardown()  # W&B's service writes the end of the log after finish(): this waits for it
            _, rows = wandb_offline.read_folder(folder)
            if len(rows) >= self.replayed:  # this folder holds the whole run: the earlier ones are not synced
                wandb_offline.set_aside(self.predecessors)
        if offline:
            self.log(f"W&B offline run {self.run.id}: upload it with `wandb sync {folder}`")
