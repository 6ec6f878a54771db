"""Watching a run end to end: a real `kiln train` with every sink and the profiler on, stopped by SIGTERM
and resumed. Each tool's records are read back with its own reader: TensorBoard's event reader, MLflow's
client on the local store, W&B's offline run files, an HTTP GET of the Prometheus endpoint while training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import stdlib_corpus, tiny_cpu_run

pytestmark = pytest.mark.slow
for _module in ("tensorboard", "wandb", "mlflow", "sqlalchemy", "prometheus_client"):
    pytest.importorskip(_module)

CHILD = r'''
import os, signal, sys, urllib.request
from kiln.config import load_config
from kiln.monitor.sinks.prometheus import PrometheusSink
from kiln.train.events import Callback
from kiln.train.run import run

stop_at, args = int(sys.argv[1]), sys.argv[2:]

class Watch(Callback):
    def on_step_end(self, trainer, metrics):
        if metrics and trainer.step == 4:  # what a scraper sees while the run trains
            sink = next(cb for cb in trainer.events.callbacks if isinstance(cb, PrometheusSink))
            body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=30).read().decode()
            print("SCRAPED", body.replace("\n", "|"))
        if trainer.step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

run(load_config(None, args), callbacks=[Watch()])
'''


def kiln_train(args: list[str], stop_at: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", CHILD, str(stop_at), *args], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLUMNS": "400", "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_every_sink_records_a_run_that_is_stopped_and_resumed(tmp_path):
    from mlflow.tracking import MlflowClient
    from prometheus_client.parser import text_string_to_metric_families
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib_corpus(corpus, 60)
    run_dir = tmp_path / "run"
    args = tiny_cpu_run(tmp_path / "cache", corpus, 8, 2, "train.eval_every=4", "train.eval_batches=1",
                        "train.sample_tokens=6", "logging.every=2", f"train.run_dir={run_dir}",
                        "logging.tensorboard=true", "logging.wandb=true", "logging.wandb_mode=offline",
                        "logging.mlflow=true", "logging.prometheus_port=0", "logging.prometheus_addr=127.0.0.1",
                        "profile.start=2", "profile.steps=2", batch_size=4, vocab_size=300)
    first = kiln_train(args, stop_at=5)  # SIGTERM in step 5: a checkpoint of step 5, then exit 0
    assert "stopped by SIGTERM after step 5" in first.stdout + first.stderr

    # Prometheus, scraped at step 4: the latest train metrics and the step
    [line] = [x for x in first.stdout.splitlines() if x.startswith("SCRAPED ")]
    scraped = {s.name: s.value for fam in text_string_to_metric_families(line[8:].replace("|", "\n"))
               for s in fam.samples}
    assert scraped["kiln_train_step"] == 4 and scraped["kiln_train_loss"] > 0
    assert "kiln_train_tokens_per_second" in scraped and scraped["kiln_train_tokens_total"] > 0

    # flushed and closed on SIGTERM: TensorBoard has every step logged, MLflow marks the run killed
    mlflow = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    assert mlflow.get_run(run_id).info.status == "KILLED"
    assert [m.step for m in mlflow.get_metric_history(run_id, "train/loss")] == [2, 4]
    wandb_id = (run_dir / "wandb_id.txt").read_text().strip()

    # the profiler: a trace of steps 2-3 only, and the top operators printed
    assert [p.name for p in (run_dir / "profile").glob("*.json")] == ["steps-2-3.pt.trace.json"]
    trace = json.loads((run_dir / "profile" / "steps-2-3.pt.trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")} == \
        {"ProfilerStep#2", "ProfilerStep#3"}
    assert "Self CPU time total" in first.stdout

    kiln_train(args)  # the same command resumes from step 5
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [e.step for e in tb.Scalars("eval/val_loss")][-1] == 8
    assert "def " in tb.Tensors("sample/text_summary")[0].tensor_proto.string_val[0].decode()
    run = mlflow.get_run(run_id)  # the same MLflow run, finished, with the final model
    assert run.info.status == "FINISHED"
    assert [m.step for m in mlflow.get_metric_history(run_id, "train/loss")] == [2, 4, 6, 8]
    assert "model/model.safetensors" in {a.path for a in mlflow.list_artifacts(run_id, "model")}
    assert (run_dir / "wandb_id.txt").read_text().strip() == wandb_id  # the same W&B run
    [newest] = Path(run_dir / "wandb").glob(f"offline-run-*-{wandb_id}")  # the whole run: the one to sync
    assert list(newest.glob(f"run-{wandb_id}.wandb")) and len(list((run_dir / "wandb" / "superseded").iterdir())) == 1
