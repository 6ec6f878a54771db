"""The profiler window on CUDA: kernels in the trace and the top table, and the memory snapshot."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from kiln.config import load_config
from kiln.events import Events
from kiln.monitor.profile import ProfileWindow

pytestmark = pytest.mark.gpu


def test_cuda_kernels_and_a_memory_snapshot_are_recorded(tmp_path):
    cfg = load_config(None, ["train.max_steps=6", "profile.start=3", "profile.steps=2", "profile.memory_snapshot=true"])
    logged: list[str] = []
    model = torch.nn.Linear(256, 256, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    trainer = SimpleNamespace(step=0, cfg=cfg, device=torch.device("cuda"))
    events = Events([ProfileWindow(cfg.profile, tmp_path, logged.append)], log=logged.append)
    events.emit("on_train_start", trainer)
    while trainer.step < 6:
        model(torch.randn(64, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
        trainer.step += 1
        events.emit("on_step_end", trainer, None)
    events.emit("on_train_end", trainer, {})
    events.emit("on_run_end", trainer, "finished")
    assert not any("failed" in line for line in logged), logged
    trace = json.loads((tmp_path / "profile" / "steps-3-4.pt.trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # CUDA kernels, not only CPU ops
    assert "Self CUDA" in (tmp_path / "profile" / "top-ops.txt").read_text()
    snapshot = pickle.loads((tmp_path / "profile" / "memory-snapshot.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]  # allocations with their history
