"""Every script in benchmarks/ starts both ways a user runs it: `python benchmarks/X.py` and
`python -m benchmarks.X` (from the repository root), here with --help, which needs no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.slow
def test_every_benchmark_prints_help_as_a_script_and_as_a_module():
    assert "loader" in SCRIPTS and "tokenize_speed" in SCRIPTS and "tokenize" not in SCRIPTS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}
    runs = {}
    for name in SCRIPTS:  # all at once: each start imports torch
        for how in (["benchmarks/" + name + ".py"], ["-m", "benchmarks." + name]):
            runs[" ".join(how)] = subprocess.Popen([sys.executable, *how, "--help"], cwd=ROOT, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = {}
    for how, proc in runs.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed[how] = out[-2000:]
    assert not failed, failed


def test_fsdp_8b_writes_the_final_checkpoint_only_where_the_disk_holds_two(monkeypatch, tmp_path, capsys):
    """An 8B checkpoint is ~96 GB: on a 128 GB disk the run keeps the mid-run one only; with no room for one
    it stops before starting a job."""
    import argparse
    import importlib
    from collections import namedtuple

    monkeypatch.syspath_prepend(str(ROOT))
    bench = importlib.import_module("benchmarks.fsdp_8b")
    usage = namedtuple("usage", "total used free")

    def plan(free_gb: float, choice: str = "auto") -> str:
        monkeypatch.setattr(bench.shutil, "disk_usage", lambda path: usage(0, 0, int(free_gb * 1e9)))
        return bench.plan_disk(argparse.Namespace(size="8b", seq=8192, run_root=str(tmp_path), final_save=choice))

    assert plan(128) == "off" and "96.4 GB" in capsys.readouterr().out
    assert plan(235) == "on"
    assert plan(128, "on") == "on" and "may fill the disk" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="larger file system"):
        plan(64)
