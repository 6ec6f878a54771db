"""`kiln inspect`: a checkpoint's facts and hash status; a run directory's tiers."""

from __future__ import annotations

import os
import subprocess
import sys

from kiln.config import derive
from kiln.state.checkpointer import Checkpointer
from kiln.state.inspect import describe

from .conftest import run_steps

PRINTS = {"config": "c0", "dataset": "d0", "tokenizer": "t0", "train_tokens": 123}


def test_inspect_run_and_checkpoint(trainer_factory, tmp_path):
    t = trainer_factory(archive_url=str(tmp_path / "arch"), keep_last=2)
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    for _ in range(3):
        run_steps(t, 2)
        t.last_eval = {"step": t.step, "val_loss": 10.0 - t.step}
        ck.save(t)
    ck.close()
    run_dir = t.cfg.train.run_dir
    (tmp_path / "run" / "config.yaml").write_text(t.cfg.to_yaml())
    damaged = tmp_path / "run" / "checkpoints" / "step_00000004" / "state.json"
    damaged.write_text(damaged.read_text().replace('"step": 4', '"step": 5'))

    out = describe(run_dir)
    assert "2 checkpoint(s)" in out and "step_00000002" not in out.split("archive")[0]
    assert "step_00000006" in out and "DAMAGED" in out and "state.json" in out
    assert "archive (" in out and "kept for best" in out

    changed = derive(t.cfg, {"train.lr": 0.5, "logging.every": 3})
    one = describe(tmp_path / "run" / "checkpoints" / "step_00000006", changed.model_dump(mode="json"))
    assert "step 6, 192 tokens seen" in one and "hashes: ok" in one and "123 train tokens" in one
    assert "* train.lr: 0.002 -> 0.5" in one and "  logging.every: 10 -> 3" in one


def test_inspect_cli_error_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 2 and "neither a checkpoint" in done.stderr and "Traceback" not in done.stderr


def test_inspect_streaming_run_has_no_manifest_and_one_hash_status(trainer_factory, tmp_path):
    t = trainer_factory()
    cfg = derive(t.cfg, {"data.streaming": True})
    prints = {"config": "c0", "dataset": "stream-5eed5eed", "tokenizer": "t0", "train_tokens": None}
    ck = Checkpointer(cfg.train.run_dir, cfg, prints, print)
    run_steps(t, 2)
    ck.save(t)
    ck.close()
    (tmp_path / "run" / "config.yaml").write_text(cfg.to_yaml())

    out = describe(tmp_path / "run")
    assert "manifest" not in out and "streamed from @stdlib" in out and "5eed5eed" in out
    assert "step_00000002" in out and "hashes: ok" in out and "not verified" not in out
    unchecked = describe(tmp_path / "run", check=False)
    assert "hashes: not verified" in unchecked and " ok" not in unchecked


def test_inspect_of_a_run_whose_config_yaml_is_broken_still_lists_its_checkpoints(trainer_factory, tmp_path):
    t = trainer_factory()
    ck = Checkpointer(t.cfg.train.run_dir, t.cfg, PRINTS, print)
    run_steps(t, 2)
    ck.save(t)
    ck.close()
    cfg_file = tmp_path / "run" / "config.yaml"
    for text, problem in [("train:\n  lr: [0.1\n", "config.yaml:3: not valid YAML"),
                          ("- a\n- b\n", "holds a list, not a config mapping"), ("", "config.yaml is empty"),
                          ("checkpoint: 3\n", "its checkpoint section is not a mapping")]:
        cfg_file.write_text(text)
        out = describe(tmp_path / "run")
        assert problem in out and "1 checkpoint(s)" in out and "step_00000002" in out, out
    cfg_file.write_text("train:\n  lr: [0.1\n")
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(tmp_path / "run")], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0 and "Traceback" not in done.stderr and "not valid YAML" in done.stdout
