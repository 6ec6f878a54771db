"""`kiln runs`: one line per run directory, its status told from its lock and files: running (a live process
holds the lock), finished, stopped (early stop or a signal) or crashed."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from typer.testing import CliRunner

from kiln.cli import app
from kiln.monitor import sinks
from kiln.monitor.runs import list_runs
from kiln.monitor.sinks import JsonlSink
from kiln.state.verify import FORMAT

HOLD = r'''
import sys, time
from pathlib import Path
from kiln.state.rundir import hold_run_dir
with hold_run_dir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()  # until the test closes our stdin
'''


def make_run(root, name, *, ckpt=None, model=False, metrics=(), max_steps=100):
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  max_steps: {max_steps}\n")
    if ckpt is not None:
        d = run / "checkpoints" / f"step_{ckpt['step']:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"format": FORMAT, "tokens_seen": ckpt["step"] * 64,
                                                 "config": {"train": {"max_steps": max_steps}}, **ckpt}))
    if model:
        (run / "model").mkdir()
        (run / "model" / "model_config.json").write_text("{}")
        (run / "model" / "model.safetensors").write_bytes(b"x")
        (run / "model" / "tokenizer.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run


def test_each_status_from_the_files(tmp_path):
    train = [{"event": "train", "time": 100.0, "step": 10, "tokens": 640, "loss": 3.0},
             {"event": "eval", "time": 130.0, "step": 10, "val_loss": 2.5},
             {"event": "eval", "time": 160.0, "step": 20, "val_loss": 2.7},
             {"event": "train", "time": 3761.0, "step": 20, "tokens": 1280, "loss": 2.0}]
    make_run(tmp_path, "a-finished", ckpt={"step": 100, "reason": "final"}, model=True, metrics=train)
    make_run(tmp_path, "b-finished-no-model", ckpt={"step": 100, "reason": "final"})
    make_run(tmp_path, "c-early", ckpt={"step": 20, "reason": "final", "stop_reason": "early stop: no better"},
             model=True, metrics=train)
    make_run(tmp_path, "d-signal", ckpt={"step": 20, "reason": "preempt"})
    make_run(tmp_path, "e-crashed", ckpt={"step": 10, "reason": "periodic"}, metrics=train)
    make_run(tmp_path, "f-crashed-at-start")
    (tmp_path / "not-a-run").mkdir()
    runs = {r.name: r for r in list_runs(tmp_path)}
    assert {n: r.status for n, r in runs.items()} == {
        "a-finished": "finished", "b-finished-no-model": "finished", "c-early": "stopped", "d-signal": "stopped",
        "e-crashed": "crashed", "f-crashed-at-start": "crashed"}
    e = runs["e-crashed"]
    assert (e.steps, e.tokens, e.best_val_loss, e.last_checkpoint) == (20, 1280, 2.5, "step_00000010")
    assert e.wall_s == 3661.0
    assert runs["c-early"].note == "early stop: no better"
    assert runs["f-crashed-at-start"].steps is None and runs["f-crashed-at-start"].last_checkpoint is None


def test_damaged_metrics_records_are_passed_over(tmp_path):
    """A cut line, a record that is not an object and records with values of the wrong type (a hand edit, a
    damaged disk) do not stop `kiln runs`: the good records of the run are summarised."""
    good = [{"event": "train", "time": 10.0, "step": 5, "tokens": 320, "loss": 3.0},
            {"event": "eval", "time": 20.0, "step": 5, "val_loss": 2.5}]
    run = make_run(tmp_path, "damaged", ckpt={"step": 5, "reason": "periodic"}, metrics=good)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('[1, 2]\n{"event": "train", "step": null, "loss": 1}\n{"event": "train", "step": 9, "tokens": "x"}\n'
                '{"event": "eval", "step": 9, "val_loss": "nan", "time": "late"}\n{"event": "eval", "step": 9, '
                '"val_loss": true}\n')
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe not UTF-8\n{"event": "train", "st')  # a damaged byte: a UnicodeDecodeError traceback
    [r] = list_runs(tmp_path)
    assert (r.steps, r.tokens, r.best_val_loss, r.wall_s) == (5, 320, 2.5, 10.0)


class Clock:
    """A fake time.time for the JSONL sink: each process of the run is a stretch of it, set by the test."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def process(path, clock, start_step, steps, status):
    """One process of a run writing metrics.jsonl: made at clock.now, 10 s per logged step, then `status`
    (None: killed, no end)."""
    sink, t = JsonlSink(path), SimpleNamespace(step=start_step)
    clock.now += 5
    sink.on_eval_end(t, {"step": start_step, "val_loss": 3.0})
    sink.on_train_start(t)
    for s in steps:
        clock.now += 10
        t.step = s
        sink.on_step_end(t, {"step": s, "tokens": 64 * s, "loss": 3.0 - s / 100})
    if status is not None:
        clock.now += 5
        sink.on_run_end(t, status)


def test_wall_time_is_the_time_the_run_ran_without_the_pauses_between_stops_and_resumes(tmp_path, monkeypatch):
    """A run stopped on Friday and resumed on Monday ran for minutes, not days; a killed process counts up to
    its last record, even though its replayed steps' records are dropped by the resume."""
    clock = Clock(1_000_000.0)
    monkeypatch.setattr(sinks, "time", clock)
    run = make_run(tmp_path, "weekend", ckpt={"step": 30, "reason": "final"}, max_steps=30)
    path = run / "metrics.jsonl"
    process(path, clock, 0, range(1, 11), "stopped")  # 5 + 100 + 5 = 110 s, stopped by a signal at step 10
    clock.now += 3 * 86400  # the weekend
    process(path, clock, 10, range(11, 21), None)  # 105 s, killed at step 20; its checkpoint is at step 15
    clock.now += 3600
    process(path, clock, 15, range(16, 31), "finished")  # 5 + 150 + 5 = 160 s
    [r] = list_runs(tmp_path)
    assert r.wall_s == 110 + 105 + 160 and r.steps == 30
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in recs if r["event"] == "train"] == list(range(1, 31))  # each step once
    assert [(r["event"], r["step"], r.get("status")) for r in recs if r["event"] in ("start", "end")] == [
        ("start", 0, None), ("end", 10, "stopped"), ("start", 10, None), ("end", 20, "killed"), ("start", 15, None),
        ("end", 30, "finished")]


def test_a_held_lock_is_running_and_a_killed_holder_is_not(tmp_path):
    run = make_run(tmp_path, "live", ckpt={"step": 10, "reason": "periodic"})
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert [r.status for r in list_runs(tmp_path)] == ["running"]
    finally:
        holder.kill()  # as kill -9: the lock file stays, the OS lock goes with the process
        holder.wait()
    assert (run / ".lock").exists()
    assert [r.status for r in list_runs(tmp_path)] == ["crashed"]


def test_cli_table_and_json(tmp_path):
    make_run(tmp_path, "a", ckpt={"step": 100, "reason": "final"}, model=True)
    make_run(tmp_path, "b", ckpt={"step": 20, "reason": "final", "stop_reason": "early stop: flat"})
    cli = CliRunner()
    res = cli.invoke(app, ["runs", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "finished" in res.output and "stopped" in res.output and "b: stopped (early stop: flat)" in res.output
    res = cli.invoke(app, ["runs", str(tmp_path), "--json"])
    assert [(r["name"], r["status"]) for r in json.loads(res.output)] == [("a", "finished"), ("b", "stopped")]
    res = cli.invoke(app, ["runs", str(tmp_path / "nope")])
    assert res.exit_code != 0


def test_an_extended_run_killed_before_its_new_end_is_killed_and_a_failed_one_failed(tmp_path, monkeypatch):
    """A run finished at step 60, extended with --resume force to 100 (config.yaml says so) and killed at step 75
    is not finished, though its first finish left a model/; a process that stopped on an error is failed."""
    clock = Clock(1_000_000.0)
    monkeypatch.setattr(sinks, "time", clock)
    run = make_run(tmp_path, "extended", ckpt={"step": 70, "reason": "periodic"}, model=True, max_steps=100)
    process(run / "metrics.jsonl", clock, 0, range(10, 61, 10), "finished")
    process(run / "metrics.jsonl", clock, 60, range(65, 76, 5), None)  # killed: no end record
    failed = make_run(tmp_path, "failed", ckpt={"step": 20, "reason": "emergency"})
    process(failed / "metrics.jsonl", clock, 0, range(10, 31, 10), "failed")
    done = make_run(tmp_path, "finished", ckpt={"step": 100, "reason": "final"}, model=True, max_steps=100)
    process(done / "metrics.jsonl", clock, 0, range(50, 101, 50), "finished")
    runs = {r.name: r for r in list_runs(tmp_path)}
    assert {n: r.status for n, r in runs.items()} == {"extended": "killed", "failed": "failed",
                                                      "finished": "finished"}
    assert "after step 75" in runs["extended"].note and "emergency checkpoint" in runs["failed"].note


def test_a_table_written_to_a_file_keeps_every_cell_whole(tmp_path):
    make_run(tmp_path, "a-rather-long-run-name-from-a-sweep", ckpt={"step": 12345678, "reason": "final"},
             model=True)
    res = CliRunner().invoke(app, ["runs", str(tmp_path)], env={"COLUMNS": "60"})  # not a terminal
    assert res.exit_code == 0, res.output
    assert "step_12345678" in res.output and "a-rather-long-run-name-from-a-sweep" in res.output
