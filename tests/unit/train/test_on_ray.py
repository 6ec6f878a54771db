"""`kiln launch ray`: kiln train on local Ray with two CPU workers (gloo) trains the run `kiln train --nproc 2`
trains: the same losses, step for step; and bad shapes are config errors before Ray starts."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from kiln.errors import ConfigError


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if (r := json.loads(line))["event"] == "train"]


@pytest.mark.slow
def test_two_ray_workers_train_as_torchrun_does(tmp_path, monkeypatch, local_ray):
    pytest.importorskip("ray.train.torch")
    from typer.testing import CliRunner

    from kiln.cli import app

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / n).read_text() for n in ("argparse.py", "textwrap.py"))
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "model": {"size": "tiny"}, "checkpoint": {"every": 2},
        "logging": {"console": False, "plots": False, "every": 1},
        "train": {"seq_len": 32, "max_steps": 4, "warmup_steps": 1, "eval_every": 0, "sample_tokens": 0,
                  "device": "cpu", "precision": "fp32", "batch_size": 2},
        "data": {"sources": ["corpus"], "val_fraction": 0.1, "vocab_size": 300, "cache_dir": "cache"}}))
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, "-m", "kiln.cli", "train", "base.yaml", "train.run_dir=torchrun", "--nproc", "2"],
                   check=True, capture_output=True)
    res = CliRunner().invoke(app, ["launch", "ray", "base.yaml", "train.run_dir=on-ray", "--workers", "2"])
    assert res.exit_code == 0, res.output
    assert len(losses(tmp_path / "on-ray")) == 4
    assert losses(tmp_path / "on-ray") == losses(tmp_path / "torchrun")
    meta = json.loads(next((tmp_path / "on-ray" / "checkpoints").glob("step_*4/meta.json")).read_text())
    assert meta["world_size"] == 2 and (tmp_path / "on-ray" / "model").is_dir()


def test_shapes_are_checked_before_ray_starts():
    from kiln.train.on_ray import launch

    with pytest.raises(ConfigError, match="at least 1"):
        launch(None, [], 0)
    with pytest.raises(ConfigError, match="would hold GPUs"):
        launch(None, ["train.device=cpu"], 2, gpus_per_worker=1)
    with pytest.raises(ConfigError, match="give each worker its GPU"):
        launch(None, ["train.device=cuda"], 2)
