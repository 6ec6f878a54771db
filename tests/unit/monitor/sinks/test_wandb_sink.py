"""W&B sink in offline mode: what it wrote, read back from W&B's offline run files (the records of the
run-<id>.wandb log, decoded with W&B's own protobuf schema, and the files it keeps for upload)."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.monitor.sinks import wandb_sink
from kiln.monitor.sinks.wandb_sink import ID_FILE, WandbSink

pytest.importorskip("wandb")
pytestmark = pytest.mark.slow  # W&B starts its service process for each run (seconds)


def records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (':W&B', magic, version), then LevelDB-log
    framing (32 KiB blocks; each chunk: crc32 (4), length (2), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, out, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


def offline_run(run_dir: Path, n: int = 0):
    """(run id, history rows as dicts, config as dict, summary, saved file names, {metric or glob: its x
    axis}) of the n-th offline run."""
    import wandb

    wandb.teardown()  # W&B's service process writes the log after finish() returns: stopping it waits for that
    [log] = sorted(run_dir.glob("wandb/offline-run-*"))[n].glob("run-*.wandb")
    history, config, summary, files, run_id, axes = [], {}, {}, set(), None, {}
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "history":
            history.append({i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                            for i in rec.history.item})
        elif kind == "summary":
            summary.update({u.nested_key[0] if u.nested_key else u.key: json.loads(u.value_json)
                            for u in rec.summary.update})
        elif kind == "files":
            files |= {f.path for f in rec.files.files}
        elif kind == "metric":
            axes[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
    return run_id, history, config, summary, files, axes


def test_offline_run_has_the_config_metrics_sample_and_files(tmp_path, drive, config):
    cfg = config("logging.wandb=true", "logging.wandb_mode=offline", "train.lr=0.004", "logging.tags={team: nlp}")
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    drive(WandbSink(cfg, tmp_path, log=print), cfg, range(1, 4), sample="def hello():")
    run_id, history, conf, summary, files, axes = offline_run(tmp_path)
    assert run_id == (tmp_path / ID_FILE).read_text().strip()
    assert conf["train"]["lr"] == 0.004 and conf["logging"]["wandb_mode"] == "offline"
    losses = [(row["step"], row["train/loss"]) for row in history if "train/loss" in row]
    assert losses == [(s, pytest.approx(10.0 / s)) for s in (1, 2, 3)]
    assert [(row["step"], row["eval/val_loss"]) for row in history if "eval/val_loss" in row] == [(0, 5.0), (3, 4.0)]
    assert axes["train/*"] == axes["eval/*"] == "step"  # the optimizer step is the charts' x axis
    assert summary["sample"] == "def hello():"
    assert {"config.yaml", ID_FILE} <= files  # the run directory's files, uploaded at the end
    [kept] = tmp_path.glob("wandb/offline-run-*/files/config.yaml")  # as they were then, for `wandb sync`
    assert kept.read_text() == cfg.to_yaml() and not kept.is_symlink()


def test_a_resumed_run_continues_the_same_wandb_run_and_keeps_replayed_steps(tmp_path, drive, config):
    """A rollback (within a process) and a resume from a checkpoint older than the last logged step both
    train steps again; W&B refuses a step below its last one, so those rows must not be logged at step=."""
    cfg = config("logging.wandb=true", "logging.wandb_mode=offline")
    sink = WandbSink(cfg, tmp_path, log=print)
    trainer = drive(sink, cfg, range(1, 5), status=None)  # steps 1-4 logged, then a bad step rolls back to 2
    trainer.step = 2
    trainer.events.emit("on_notice", trainer, "rollback", {"message": "rolled back to step 2"})
    for s in (3, 4):
        trainer.step = s
        trainer.events.emit("on_step_end", trainer, {"step": s, "loss": 1.0 / s})
    trainer.events.emit("on_run_end", trainer, "stopped")
    first = offline_run(tmp_path)

    def steps(rows):  # the optimizer step of each train row
        return [row["step"] for row in rows if "train/loss" in row]

    assert steps(first[1]) == [1, 2, 3, 4, 3, 4]
    assert [row["train/loss"] for row in first[1] if "train/loss" in row][-2:] == [pytest.approx(1 / 3), 0.25]
    drive(WandbSink(cfg, tmp_path, log=print), cfg, range(3, 6), start=2)  # resumed from the checkpoint at 2
    whole = offline_run(tmp_path)  # the one offline folder left: the earlier process's history, then this one's
    assert whole[0] == first[0] == (tmp_path / ID_FILE).read_text().strip()
    assert steps(whole[1]) == [1, 2, 3, 4, 3, 4, 3, 4, 5]
    w_steps = [row["_step"] for row in whole[1]]
    assert w_steps == sorted(set(w_steps))  # W&B's own step only grows


@pytest.fixture
def no_server(monkeypatch):
    """W&B's server as a machine without a network to it has: an address that takes connections and never
    answers (a dropped route), with an API key, so that W&B tries it; its own lookups get nowhere either.
    Yields the listening socket (its backlog holds the connections W&B made)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
        monkeypatch.delenv("WANDB_MODE", raising=False)
        yield server


@pytest.mark.parametrize("case", ["unreachable, our timeout", "unreachable, WANDB_INIT_TIMEOUT", "no API key"])
def test_online_without_a_network_or_a_key_says_so_and_logs_offline_at_once(tmp_path, drive, config, no_server,
                                                                           monkeypatch, case):
    """Online, W&B retries for 90 s (and looks the account up, 5 s twice) before it gives up; the sink gives it
    INIT_TIMEOUT_S (20 s) or the user's WANDB_INIT_TIMEOUT, then logs the same run offline, says why and how to
    upload it, and training goes on."""
    if case == "unreachable, our timeout":
        monkeypatch.setattr(wandb_sink, "INIT_TIMEOUT_S", 1.0)
    else:
        monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")
    if case == "no API key":
        monkeypatch.delenv("WANDB_API_KEY")
    cfg = config("logging.wandb=true", "logging.wandb_mode=online")
    logged = []
    drive(WandbSink(cfg, tmp_path, log=logged.append), cfg, range(1, 4))
    run_id, history, *_ = offline_run(tmp_path)
    assert run_id == (tmp_path / ID_FILE).read_text().strip()
    assert [row["step"] for row in history if "train/loss" in row] == [1, 2, 3]
    said, started, upload = logged
    assert said.startswith("W&B could not start the online run (") and f"wandb sync {tmp_path / 'wandb'}" in said
    assert ("No API key" in said) if case == "no API key" else ("CommError" in said and "127.0.0.1" in said)
    assert "An online run gets 1 s to start (WANDB_INIT_TIMEOUT)" in said
    assert started == f"W&B run {run_id} (offline)" and upload.startswith(f"W&B offline run {run_id}: upload it")


def test_wandb_mode_offline_in_the_environment_logs_offline_without_trying_the_server(tmp_path, drive, config,
                                                                                      no_server, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")  # were the server tried, the test would not wait long for it
    cfg = config("logging.wandb=true", "logging.wandb_mode=online")
    logged = []
    drive(WandbSink(cfg, tmp_path, log=logged.append), cfg, range(1, 3))
    run_id, history, *_ = offline_run(tmp_path)
    assert logged[0] == f"W&B run {run_id} (offline)" and len(logged) == 2
    assert [row["step"] for row in history if "train/loss" in row] == [1, 2]
    with pytest.raises(BlockingIOError):
        no_server.accept()  # nothing connected to the server


KILLED_CHILD = """
import sys, time
from pathlib import Path
from types import SimpleNamespace

import torch

from kiln.config import load_config
from kiln.events import Events
from kiln.monitor.sinks.wandb_sink import WandbSink

cfg = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline"])
events = Events([WandbSink(cfg, Path(sys.argv[1]), log=print)], log=print)
trainer = SimpleNamespace(step=0, cfg=cfg, device=torch.device("cpu"), events=events)
events.emit("on_train_start", trainer)
for s in range(1, 11):
    trainer.step = s
    events.emit("on_step_end", trainer, {"step": s, "loss": 10.0 / s})
print("logged", flush=True)
time.sleep(600)
"""


def logged_steps(run_dir: Path) -> list[int]:
    """The train steps the .wandb file of the run's one offline folder holds so far ([] before it has them)."""
    try:
        [log] = [f for d in run_dir.glob("wandb/offline-run-*") for f in d.glob("run-*.wandb")]
        rows = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
                for r in records(log) if r.WhichOneof("record_type") == "history"]
    except (ValueError, AssertionError, OSError):  # no file yet, or its header not written yet
        return []
    return [row["step"] for row in rows if "train/loss" in row]


def kill_after_logging(run_dir: Path) -> None:
    """Run a process that logs steps 1-10 offline, then kill it and W&B's service with it (SIGKILL to its
    process group, as a scheduler ends a job) once W&B has written them, or once it has had the time to
    (wandb_sink.FLUSH_S twice, and a second)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        for line in child.stdout:
            if line.startswith("logged"):
                break
        deadline = time.monotonic() + wandb_sink.FLUSH_S * 2 + 1
        while time.monotonic() < deadline and len(logged_steps(run_dir)) < 10:
            time.sleep(0.1)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_a_killed_and_resumed_run_is_one_offline_run_that_sync_uploads_whole(tmp_path, drive, config):
    """W&B's 15 s default flush left a killed process's .wandb at 7 bytes, and the resumed process wrote a
    second folder of the same id whose history began again at _step 0, which `wandb sync` uploads over the
    first. Now the killed process keeps what it logged, and the newest folder holds the whole run."""
    kill_after_logging(tmp_path)
    [killed] = tmp_path.glob("wandb/offline-run-*")
    assert [row["step"] for row in offline_run(tmp_path)[1] if "train/loss" in row] == list(range(1, 11))
    cfg = config("logging.wandb=true", "logging.wandb_mode=offline")
    logged = []
    drive(WandbSink(cfg, tmp_path, log=logged.append), cfg, range(6, 13), start=5)  # resumed from step 5
    [newest] = tmp_path.glob("wandb/offline-run-*")  # the one folder `wandb sync wandb/offline-run-*` uploads
    assert newest != killed and (tmp_path / "wandb" / "superseded" / killed.name).is_dir()
    run_id, history, *_ = offline_run(tmp_path)
    assert run_id == (tmp_path / ID_FILE).read_text().strip()
    train = [(row["step"], row["train/loss"]) for row in history if "train/loss" in row]
    assert train == [(s, pytest.approx(10.0 / s)) for s in [*range(1, 11), *range(6, 13)]]  # replayed steps kept
    assert [row["_step"] for row in history] == list(range(len(history)))
    assert logged[-1] == f"W&B offline run {run_id}: upload it with `wandb sync {newest}`"
    drive(WandbSink(cfg, tmp_path, log=print), cfg, range(13, 15), start=12)  # a third process: all three
    train = [row["step"] for row in offline_run(tmp_path)[1] if "train/loss" in row]
    assert train == [*range(1, 11), *range(6, 15)] and len(list(tmp_path.glob("wandb/offline-run-*"))) == 1


def test_a_process_killed_while_it_copied_its_predecessors_history_adds_nothing(tmp_path, drive, config):
    from kiln.monitor.sinks.wandb_offline import REPLAYED, resolved_history

    cfg = config("logging.wandb=true", "logging.wandb_mode=offline")
    drive(WandbSink(cfg, tmp_path, log=print), cfg, range(1, 5), status="stopped")
    sink = WandbSink(cfg, tmp_path, log=print)
    drive(sink, cfg, range(5, 7), start=4, status="stopped")
    [second] = tmp_path.glob("wandb/offline-run-*")
    (second / REPLAYED).write_text('{"rows": 1000}')  # as if it was killed before its copy was written
    first = next((tmp_path / "wandb" / "superseded").iterdir())
    first.rename(tmp_path / "wandb" / first.name)  # (its end would have left the first folder in place)
    history, used = resolved_history(tmp_path / "wandb", sink.run.id)
    assert [row["step"] for row in history if "train/loss" in row] == [1, 2, 3, 4]
    assert sorted(used) == sorted([tmp_path / "wandb" / first.name, second])


def test_events_are_rows_marked_at_their_step_and_the_latest_of_each_kind_is_in_the_summary(tmp_path, drive,
                                                                                             config):
    cfg = config("logging.wandb=true", "logging.wandb_mode=offline")
    trainer = drive(WandbSink(cfg, tmp_path, log=print), cfg, range(1, 5), status=None)
    trainer.events.emit("on_notice", trainer, "auto_batch", {"step": 0, "batch_size": 8, "message": "chose 8"})
    trainer.step = 2
    trainer.events.emit("on_notice", trainer, "rollback", {"to_step": 2, "bad_step": 4, "message": "back to 2"})
    trainer.events.emit("on_notice", trainer, "warning", {"step": 3, "condition": "host_memory"})
    trainer.events.emit("on_run_end", trainer, "stopped")
    _, history, _, summary, _, axes = offline_run(tmp_path)
    marks = [(row["step"], k) for row in history for k in row if k.startswith("events/")]
    assert marks == [(0, "events/auto_batch"), (2, "events/rollback"), (3, "events/warning")]
    assert summary["events/rollback"] == "step 2: back to 2"
    assert summary["events/warning"] == "step 3: warning: condition=host_memory"
    assert axes["events/*"] == "step"


@pytest.mark.parametrize("url", ["closed port", "unknown host"])
def test_a_server_that_cannot_be_reached_logs_offline_without_waiting(tmp_path, drive, config, monkeypatch, url):
    """Without a network W&B held the start 20-90 s; a name that does not resolve or a port that refuses the
    connection is found in well under a second, before W&B's own retries."""
    import time

    if url == "closed port":
        with socket.create_server(("127.0.0.1", 0)) as s:
            port = s.getsockname()[1]  # closed when the block ends: connections are refused
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    else:
        monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.invalid")  # .invalid never resolves (RFC 2606)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(wandb_sink, "INIT_TIMEOUT_S", 60.0)  # were W&B tried, the test would wait a minute
    cfg = config("logging.wandb=true", "logging.wandb_mode=online")
    logged = []
    sink = WandbSink(cfg, tmp_path, log=logged.append)
    start = time.perf_counter()
    sink.open(SimpleNamespace(step=0, cfg=cfg))
    took = time.perf_counter() - start
    sink.opened = True
    drive(sink, cfg, range(1, 3))
    assert logged[0].startswith("W&B could not start the online run (ConnectionError: ")
    assert ("cannot be reached" if url == "closed port" else "does not resolve") in logged[0]
    assert logged[1] == f"W&B run {sink.run.id} (offline)" and took < 20  # W&B's offline start included
    assert [row["step"] for row in offline_run(tmp_path)[1] if "train/loss" in row] == [1, 2]


def test_a_finished_run_uploads_its_model_as_an_artifact_in_its_group_and_job_type(tmp_path, drive, config):
    from kiln.monitor.sinks.wandb_offline import records as read_log

    model = tmp_path / "model"
    model.mkdir()
    for name, data in [("model.safetensors", b"weights"), ("model_config.json", "{}"), ("tokenizer.json", "{}")]:
        (model / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    cfg = config("logging.wandb=true", "logging.wandb_mode=offline", "logging.wandb_group=ablation-7",
                 "logging.wandb_job_type=pretrain")
    drive(WandbSink(cfg, tmp_path, log=print), cfg, range(1, 4))
    offline_run(tmp_path)  # W&B's service has written the log
    [log] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    recs = read_log(log)
    [run] = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "ablation-7" and run.job_type == "pretrain"
    [artifact] = [r.artifact for r in recs if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "model" and set(artifact.aliases) >= {"latest", "step-3"}
    assert {e.path for e in artifact.manifest.contents} == {"model.safetensors", "model_config.json", "tokenizer.json"}


def test_log_model_off_uploads_no_model(tmp_path, drive, config):
    from kiln.monitor.sinks.wandb_offline import records as read_log

    (tmp_path / "model").mkdir()
    for name in ("model.safetensors", "model_config.json", "tokenizer.json"):
        (tmp_path / "model" / name).write_text("{}")
    cfg = config("logging.wandb=true", "logging.wandb_mode=offline", "logging.log_model=false")
    drive(WandbSink(cfg, tmp_path, log=print), cfg, range(1, 3))
    offline_run(tmp_path)
    [log] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert not [r for r in read_log(log) if r.WhichOneof("record_type") == "artifact"]


def test_histograms_are_wandb_histograms_at_their_step(tmp_path, drive, config):
    import torch

    cfg = config("logging.wandb=true", "logging.wandb_mode=offline", "logging.histograms_every=2")
    sink = WandbSink(cfg, tmp_path, log=print)
    trainer = drive(sink, cfg, range(1, 3), status=None)
    sink.histograms(2, {"layers.0.w": torch.linspace(-1, 1, 50)}, {"layers.0.w": 0.5, "embed": 2.0})
    trainer.events.emit("on_run_end", trainer, "finished")
    [row] = [r for r in offline_run(tmp_path)[1] if "weights/layers.0.w" in r]
    assert row["step"] == 2 and "grad_norms/per_parameter" in row  # (W&B stores a histogram's bins and counts)
