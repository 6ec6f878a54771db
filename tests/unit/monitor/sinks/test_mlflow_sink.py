"""MLflow sink: what it records, read back with MlflowClient from the local store it makes by default."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.events import Events
from kiln.monitor.sinks.mlflow_sink import ID_FILE, MlflowSink, flatten

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
pytestmark = pytest.mark.slow  # MLflow makes its SQLite store's tables in each test (seconds)


def client(run_dir):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")


def test_params_metrics_tags_samples_and_the_model_are_recorded(tmp_path, drive, config):
    cfg = config("logging.mlflow=true", "logging.tags={team: nlp}", "train.lr=0.004")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    drive(MlflowSink(cfg, tmp_path, log=print), cfg, range(1, 5), sample="def hello():")

    c = client(tmp_path)
    run = c.get_run((tmp_path / ID_FILE).read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["train.lr"] == "0.004" and run.data.params["logging.mlflow"] == "True"
    assert run.data.tags["team"] == "nlp" and run.data.tags["kiln.run_dir"] == str(tmp_path.resolve())
    assert [(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "train/loss")] == \
        [(s, pytest.approx(10.0 / s)) for s in range(1, 5)]
    assert [(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "eval/val_loss")] == [(0, 5.0), (4, 4.0)]
    # a name MLflow refuses ("%"), as a resource monitor's key may be, is sanitised
    assert [m.value for m in c.get_metric_history(run.info.run_id, "train/gpu0.util_")] == [51.0, 52.0, 53.0, 54.0]
    artifacts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"model", "config.yaml", "samples"} <= artifacts and "mlflow.db" not in artifacts
    assert [a.path for a in c.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    got = c.download_artifacts(run.info.run_id, "samples/step_4.txt", str(tmp_path / "got"))
    assert Path(got).read_text() == "def hello():"


def test_a_stopped_run_is_killed_and_its_resume_continues_the_same_mlflow_run(tmp_path, drive, config):
    cfg = config("logging.mlflow=true")
    drive(MlflowSink(cfg, tmp_path, log=print), cfg, range(1, 4), status="stopped")
    c = client(tmp_path)
    run_id = (tmp_path / ID_FILE).read_text().strip()
    assert c.get_run(run_id).info.status == "KILLED"
    assert {a.path for a in c.list_artifacts(run_id)}.isdisjoint({"model"})  # no model: the run did not finish

    again = config("logging.mlflow=true", "train.max_steps=500")  # a param that changed, and one more step
    drive(MlflowSink(again, tmp_path, log=print), again, range(3, 6), start=2)
    runs = c.search_runs([c.get_experiment_by_name("kiln").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].info.status == "FINISHED"
    # step 3, logged before the stop, is trained again: its new value goes under replay/, each chart has a step once
    assert [m.step for m in c.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4, 5]
    replayed = c.get_metric_history(run_id, "replay/train/loss")
    assert [(m.step, m.value) for m in replayed] == [(3, pytest.approx(10 / 3))]
    assert [m.step for m in c.get_metric_history(run_id, "eval/val_loss")] == [0, 2, 5]
    params = runs[0].data.params
    assert params["train.max_steps"] == "300"  # MLflow params never change: the first run's, and beside it
    assert params["train.max_steps/from_step_2"] == "500"  # the value the resume changed it to, from its step
    assert runs[0].data.tags["kiln.config_changes"] == "at step 2: train.max_steps 300 -> 500"
    assert not any(k.endswith("from_step_2") for k in params if not k.startswith("train.max_steps"))
    again = config("logging.mlflow=true", "train.max_steps=700")  # resumed again: the latest value is compared
    drive(MlflowSink(again, tmp_path, log=print), again, range(6, 8), start=5)
    params = c.get_run(run_id).data.params
    assert params["train.max_steps/from_step_5"] == "700" and params["train.max_steps/from_step_2"] == "500"
    assert c.get_run(run_id).data.tags["kiln.config_changes"] == "at step 5: train.max_steps 500 -> 700"
    drive(MlflowSink(again, tmp_path, log=print), again, range(8, 9), start=7)  # unchanged: nothing new
    assert c.get_run(run_id).data.params == params


def test_artifacts_of_a_custom_local_store_go_beside_it_not_to_the_launch_directory(tmp_path, drive, config,
                                                                                   monkeypatch):
    """With logging.mlflow_tracking_uri=sqlite:///..., MLflow's default artifact root is ./mlruns of the directory
    the run was launched from."""
    launch = tmp_path / "launch"
    launch.mkdir()
    monkeypatch.chdir(launch)
    store = tmp_path / "tracking" / "store.db"
    store.parent.mkdir()
    cfg = config("logging.mlflow=true", f"logging.mlflow_tracking_uri=sqlite:///{store}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    drive(MlflowSink(cfg, run_dir, log=print), cfg, range(1, 3), sample="text")
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{store}")
    run = c.get_run((run_dir / ID_FILE).read_text().strip())
    assert run.info.artifact_uri.startswith((store.parent / "mlartifacts").as_uri())
    assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {"config.yaml", "samples"}
    assert (store.parent / "mlartifacts").is_dir() and list(launch.iterdir()) == []


def test_steps_a_rollback_trains_again_are_logged_once_under_their_names_and_again_under_replay(tmp_path, drive,
                                                                                                 config):
    """MLflow keeps every value logged at a step: the steps after a rollback, logged again as they were, would
    draw train/loss back over them. Their second values go to replay/train/..., and a resume after it too."""
    cfg = config("logging.mlflow=true")
    trainer = drive(MlflowSink(cfg, tmp_path, log=print), cfg, range(1, 6), status=None)  # steps 1-5 logged
    trainer.step = 2  # a bad step 5 rolls back to step 2: steps 3-5 are trained again, on other batches
    trainer.events.emit("on_notice", trainer, "rollback", {"message": "rolled back to step 2"})
    for s in (3, 4, 5, 6):
        trainer.step = s
        trainer.events.emit("on_step_end", trainer, {"step": s, "loss": 1.0 / s})
    trainer.events.emit("on_run_end", trainer, "stopped")
    resumed = MlflowSink(cfg, tmp_path, log=print)
    drive(resumed, cfg, range(6, 8), start=5)  # resumed from a checkpoint at 5

    c = client(tmp_path)
    run_id = (tmp_path / ID_FILE).read_text().strip()
    first = [(m.step, m.value) for m in c.get_metric_history(run_id, "train/loss")]
    assert first == [(s, pytest.approx(10.0 / s)) for s in range(1, 6)] + [(6, 1 / 6), (7, pytest.approx(10 / 7))]
    again = [(m.step, m.value) for m in c.get_metric_history(run_id, "replay/train/loss")]
    assert again == [(3, 1 / 3), (4, 0.25), (5, 0.2), (6, pytest.approx(10 / 6))]
    assert [m.step for m in c.get_metric_history(run_id, "eval/val_loss")] == [0, 5, 7]  # no eval step is replayed
    assert c.get_metric_history(run_id, "replay/eval/val_loss") == []
    # the highest steps, from what get_run read or (another MLflow's RunData) from the metrics' histories
    run = c.get_run(run_id)
    assert resumed._highest(run) == resumed._highest(SimpleNamespace(info=run.info, data=SimpleNamespace(
        metrics=run.data.metrics))) == {"train": 7, "eval": 7}


def test_a_store_that_cannot_be_written_is_named_and_the_sink_disabled(tmp_path, config):
    (tmp_path / "a-file").write_text("not a directory")
    uri = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    cfg = config("logging.mlflow=true", f"logging.mlflow_tracking_uri={uri}")
    sink, logged = MlflowSink(cfg, tmp_path / "run", log=print), []
    events = Events([sink], log=logged.append)
    trainer = SimpleNamespace(step=0, cfg=cfg)
    events.emit("on_train_start", trainer)
    events.emit("on_step_end", trainer, {"step": 1, "loss": 1.0})
    assert sink.disabled and len(logged) == 1  # once, and training goes on
    assert f"MLflow tracking URI {uri} (logging.mlflow_tracking_uri) cannot be used" in logged[0]


def test_flatten_gives_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": "1", "a.c.d": "[1, 2]", "e": "{}"}



def test_events_are_tags_and_marks_on_the_charts(tmp_path, drive, config):
    cfg = config("logging.mlflow=true")
    trainer = drive(MlflowSink(cfg, tmp_path, log=print), cfg, range(1, 5), status=None)
    for kind, info in [("oom", {"step": 1, "micro_batch": 4, "message": "out of memory: micro-batch 4"}),
                       ("warning", {"step": 3, "message": "data waits 40%"}),
                       ("warning", {"step": 4, "message": "host memory 95%"})]:
        trainer.events.emit("on_notice", trainer, kind, info)
    trainer.events.emit("on_run_end", trainer, "finished")
    c = client(tmp_path)
    run = c.get_run((tmp_path / ID_FILE).read_text().strip())
    assert run.data.tags["kiln.event.oom"] == "step 1: out of memory: micro-batch 4"
    assert run.data.tags["kiln.event.warning"] == "step 4: host memory 95%"  # the latest of its kind
    assert [(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "events/warning")] == [(3, 1), (4, 1)]


def test_log_model_off_keeps_the_model_out_of_the_store(tmp_path, drive, config):
    cfg = config("logging.mlflow=true", "logging.log_model=false")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    drive(MlflowSink(cfg, tmp_path, log=print), cfg, range(1, 3))
    c = client(tmp_path)
    run_id = (tmp_path / ID_FILE).read_text().strip()
    artifacts = {a.path for a in c.list_artifacts(run_id)}
    assert "config.yaml" in artifacts and "model" not in artifacts
