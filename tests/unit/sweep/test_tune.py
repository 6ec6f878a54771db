"""`kiln sweep` on local Ray: tiny trials on the CPU, each an ordinary run directory, the results table and
the best config written out."""

from __future__ import annotations

import csv
import sysconfig
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.tune")


@pytest.mark.slow
def test_a_grid_sweep_with_asha(tmp_path, monkeypatch, local_ray):
    from typer.testing import CliRunner

    from kiln.cli import app
    from kiln.monitor.runs import list_runs

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / n).read_text() for n in ("argparse.py", "textwrap.py"))
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "model": {"size": "tiny"}, "checkpoint": {"every": 0}, "logging": {"console": False, "plots": False},
        "train": {"seq_len": 32, "max_steps": 6, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1,
                  "sample_tokens": 0, "device": "cpu", "precision": "fp32", "batch_size": 4},
        "data": {"sources": ["corpus"], "val_fraction": 0.1, "vocab_size": 300, "cache_dir": "cache"}}))
    (tmp_path / "space.yaml").write_text("search: grid\nasha: {grace: 1, reduction: 2}\n"
                                         "params:\n  train.lr: {grid: [1.0e-3, 1.0e-6]}\n")
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where kiln sweep runs
    result = CliRunner().invoke(app, ["sweep", "base.yaml", "--space", "space.yaml", "--trials", "1", "--out", "sw",
                                      "--cpus-per-trial", "1"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "sw" / "results.csv").open()))
    assert sorted(float(r["train.lr"]) for r in rows) == [1e-6, 1e-3]
    # a learning rate of 1e-6 learns nothing in six steps: the sweep picks 1e-3
    assert yaml.safe_load((tmp_path / "sw" / "best.yaml").read_text())["train"]["lr"] == 1e-3
    best = min(rows, key=lambda r: float(r["best_val_loss"]))
    assert float(best["train.lr"]) == 1e-3 and "best: trial" in result.output
    runs = {r.name: r for r in list_runs(tmp_path / "sw" / "trials")}
    assert set(runs) == {Path(r["run_dir"]).name for r in rows}
    # the better trial ran out (4 evaluations, its model saved); ASHA may stop the other after its first rung
    assert best["evaluations"] == "4" and best["status"] == "finished" and runs[Path(best["run_dir"]).name].status \
        == "finished"
