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
