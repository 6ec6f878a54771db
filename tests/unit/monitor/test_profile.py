"""The profiler window records the configured optimizer steps, and only those, into a Chrome trace."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from kiln.config import load_config
from kiln.events import Events
from kiln.monitor.profile import ProfileWindow


def train(run_dir, steps: int, *overrides: str, start: int = 0, stop_at: int | None = None) -> list[str]:
    """A small real training loop emitting the trainer's events; each step is marked 'train step N'.
    With `stop_at`, the run stops after that step as on SIGTERM (no on_train_end)."""
    cfg = load_config(None, [f"train.max_steps={steps}", *overrides])
    logged: list[str] = []
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = SimpleNamespace(step=start, cfg=cfg, device=torch.device("cpu"))
    events = Events([ProfileWindow(cfg.profile, run_dir, logged.append)], log=logged.append)
    events.emit("on_train_start", trainer)
    while trainer.step < steps:
        with torch.profiler.record_function(f"train step {trainer.step + 1}"):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        trainer.step += 1
        events.emit("on_step_end", trainer, None)
        if trainer.step == stop_at:
            break
    if stop_at is None:
        events.emit("on_train_end", trainer, {})
    events.emit("on_run_end", trainer, "finished" if stop_at is None else "stopped")
    assert not any("failed" in line for line in logged), logged
    return logged


def names(trace) -> set[str]:
    return {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if "name" in e}


def test_the_trace_holds_the_window_steps_only(tmp_path):
    logged = train(tmp_path, 8, "profile.start=3", "profile.steps=2")
    [trace] = (tmp_path / "profile").glob("*.pt.trace.json")
    assert trace.name == "steps-3-4.pt.trace.json"
    got = names(trace)
    assert {n for n in got if n.startswith("train step")} == {"train step 3", "train step 4"}  # not 2 (warm-up)
    assert {n for n in got if n.startswith("ProfilerStep#")} == {"ProfilerStep#3", "ProfilerStep#4"}
    assert "aten::addmm" in got  # the operators inside, with their shapes recorded
    top = (tmp_path / "profile" / "top-ops.txt").read_text()
    assert "Self CPU" in top and top.strip() in "\n".join(logged)  # the top operators are printed too


def test_a_light_trace_leaves_out_the_operators_shapes(tmp_path):
    def dims(run_dir, *overrides) -> int:
        train(run_dir, 3, "profile.start=2", "profile.steps=1", *overrides)
        [trace] = (run_dir / "profile").glob("*.pt.trace.json")
        return sum("Input Dims" in e.get("args", {}) for e in json.loads(trace.read_text())["traceEvents"])

    assert dims(tmp_path / "full") > 0
    assert dims(tmp_path / "light", "profile.shapes=false") == 0


def test_a_window_cut_short_by_the_end_of_training_is_written(tmp_path):
    train(tmp_path, 4, "profile.start=3", "profile.steps=5")
    [trace] = (tmp_path / "profile").glob("*.pt.trace.json")
    assert trace.name == "steps-3-4.pt.trace.json"
    assert {n for n in names(trace) if n.startswith("train step")} == {"train step 3", "train step 4"}


def test_a_stop_inside_the_window_still_writes_the_trace(tmp_path):
    train(tmp_path, 10, "profile.start=2", "profile.steps=5", stop_at=4)
    [trace] = (tmp_path / "profile").glob("*.pt.trace.json")
    assert trace.name == "steps-2-4.pt.trace.json"
    assert {n for n in names(trace) if n.startswith("train step")} == {f"train step {i}" for i in (2, 3, 4)}


def test_the_first_step_can_be_profiled_without_a_warm_up(tmp_path):
    train(tmp_path, 3, "profile.start=1", "profile.steps=2")
    [trace] = (tmp_path / "profile").glob("*.pt.trace.json")
    assert {n for n in names(trace) if n.startswith("train step")} == {"train step 1", "train step 2"}


def test_a_resume_past_the_window_profiles_nothing(tmp_path):
    logged = train(tmp_path, 8, "profile.start=3", "profile.steps=2", start=5)
    assert not (tmp_path / "profile").exists() and "nothing is profiled" in logged[0]
