"""metrics.jsonl holds each step once, also after a resume replays steps; the sinks `logging:` enables."""

import io
import json
import re
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from kiln.config import MonitorConfig, load_config
from kiln.errors import ConfigError
from kiln.events import Events
from kiln.monitor.resources import ResourceMonitor
from kiln.monitor.sinks import ConsoleSink, JsonlSink, enabled_sinks


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_drops_replayed_records_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    t = SimpleNamespace(step=0)
    first.on_eval_end(t, {"step": 0, "val_loss": 9.0})
    for s in range(1, 9):
        t.step = s
        first.on_step_end(t, {"step": s, "loss": 10.0 - s})
        if s == 4:
            first.on_eval_end(t, {"step": 4, "val_loss": 5.0})
    first.file.write('{"event": "train", "st')  # killed mid-line
    first.file.flush()

    again = JsonlSink(path)  # resumed from the checkpoint of step 4
    t = SimpleNamespace(step=4)
    again.on_eval_end(t, {"step": 4, "val_loss": 5.5})
    again.on_train_start(t)
    for s in range(5, 7):
        t.step = s
        again.on_step_end(t, {"step": s, "loss": 20.0 + s})
    again.on_train_end(t, {})

    got = records(path)
    train = [(r["step"], r["loss"]) for r in got if r["event"] == "train"]
    evals = [(r["step"], r["val_loss"]) for r in got if r["event"] == "eval"]
    assert train == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 25.0), (6, 26.0)]
    assert evals == [(0, 9.0), (4, 5.5)]
    # the first process died without its `end`: the resume wrote it, at the last step that process logged
    assert [(r["event"], r["step"], r.get("status")) for r in got if r["event"] in ("start", "end")] == [
        ("start", 0, None), ("end", 8, "killed"), ("start", 4, None)]


def test_resume_and_plots_pass_over_damaged_lines(tmp_path):
    """A resumed run rewrites metrics.jsonl without its replayed records: a damaged byte (UnicodeDecodeError), a
    line that parses as a number (AttributeError) or a step that is no number (TypeError) stopped the run's start
    with a traceback, and `kiln plot` with the first."""
    from kiln.monitor.plots import read_metrics

    path = tmp_path / "metrics.jsonl"
    first, t = JsonlSink(path), SimpleNamespace(step=1)
    first.on_step_end(t, {"step": 1, "loss": 3.0})
    first.file.close()
    with open(path, "ab") as f:
        f.write(b'7\n{"event": "train", "step": "x"}\n\xff\xfe damaged\n')
    assert read_metrics(tmp_path).series("train", "loss", "step") == ([1], [3.0])
    again = JsonlSink(path)
    again.on_train_start(SimpleNamespace(step=1))
    again.on_step_end(SimpleNamespace(step=2), {"step": 2, "loss": 2.0})
    again.file.close()
    assert read_metrics(tmp_path).series("train", "loss", "step") == ([1, 2], [3.0, 2.0])


def test_fresh_run_keeps_everything(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    t = SimpleNamespace(step=0)
    sink.on_eval_end(t, {"step": 0, "val_loss": 1.0})
    sink.on_train_start(t)
    t.step = 1
    sink.on_step_end(t, {"step": 1, "loss": 2.0})
    sink.on_step_end(t, None)  # not a logging step
    sink.on_run_end(t, "finished")
    assert [r["event"] for r in records(tmp_path / "m.jsonl")] == ["start", "eval", "train", "end"]


@pytest.mark.parametrize("setting, module, extra", [
    ("logging.tensorboard=true", "tensorboard", "tensorboard"),
    ("logging.wandb=true", "wandb", "wandb"),
    ("logging.mlflow=true", "mlflow", "mlflow"),
    ("logging.prometheus_port=9100", "prometheus_client", "prometheus"),
])
def test_a_sink_whose_package_is_missing_is_a_config_error_naming_the_extra(tmp_path, monkeypatch, setting, module,
                                                                            extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ConfigError, match=re.escape(f"pip install 'kiln[{extra}]'")) as e:
        enabled_sinks(load_config(None, [setting]), tmp_path, print)
    assert setting.split("=")[0] in str(e.value)


def test_no_sink_is_built_or_imported_unless_enabled(tmp_path, monkeypatch):
    for module in ("tensorboard", "wandb", "mlflow", "prometheus_client"):
        monkeypatch.setitem(sys.modules, module, None)
    assert enabled_sinks(load_config(None, []), tmp_path, print) == []


def test_the_console_says_each_notice_once():
    """A resource warning is printed by the monitor as it happens; the console sink does not print it again
    (it prints the other notices' messages, as a rollback's)."""
    out = io.StringIO()
    console = Console(file=out, width=300)
    monitor = ResourceMonitor(MonitorConfig(), SimpleNamespace(sample=lambda: {"host_mem_percent": 99.0}),
                              checkpoint_bytes=0, log=console.print, thread=False)
    trainer = SimpleNamespace(step=0, cfg=load_config(None, []))
    trainer.events = Events([monitor, ConsoleSink(console)])
    trainer.events.emit("on_train_start", trainer)
    trainer.step = 1
    trainer.events.emit("on_step_end", trainer, {"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 9.0,
                                                 "data_wait": 0.5})
    trainer.events.emit("on_notice", trainer, "rollback", {"message": "step 1 went bad: rolled back to step 0"})
    trainer.events.emit("on_train_end", trainer, {})
    text = out.getvalue()
    assert text.count("host memory is 99% used") == 1 and text.count("rolled back to step 0") == 1


def test_a_console_that_is_not_a_terminal_gets_a_plain_line_per_logging_step():
    """Written to a file (Slurm, kubectl logs, nohup), a progress bar shows only its end: a line per logging step
    instead, with the step of the total, loss, lr, tokens/s, time left and memory."""
    out = io.StringIO()
    console = Console(file=out, width=80)  # a file: not a terminal
    assert not console.is_terminal
    trainer = SimpleNamespace(step=0, cfg=load_config(None, ["train.max_steps=40"]))
    sink = ConsoleSink(console)
    sink.on_train_start(trainer)
    for step in range(1, 41):
        trainer.step = step
        metrics = {"step": step, "loss": 5.0 - step / 100, "lr": 1e-3, "tokens_per_s": 2530.0,
                   "sys/rss_gib": 0.42} if step % 10 == 0 else None
        sink.on_step_end(trainer, metrics)
    sink.on_train_end(trainer, {})
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(lines) == 4, out.getvalue()
    assert lines[1].startswith("step 20/40 (50%)  loss 4.8000  lr 1.00e-03  2,530 tok/s  eta ")
    assert lines[1].endswith("mem host 0.42 GiB") and lines[-1].split("  ")[4] == "eta 0s"
    assert all(len(line) > 80 for line in lines)  # never wrapped at the console's width


def test_a_notice_is_printed_as_written_not_read_as_markup():
    out = io.StringIO()
    trainer = SimpleNamespace(step=0, cfg=load_config(None, []))
    Events([ConsoleSink(Console(file=out, width=300))]).emit(
        "on_notice", trainer, "auto_batch", {"message": "install it: pip install 'kiln[gpu]' [bold]x[/bold]"})
    assert "pip install 'kiln[gpu]' [bold]x[/bold]" in out.getvalue()
