"""The run directory's lock: one job at a time, refused with the holder's name; a killed holder leaves
nothing that blocks; the ranks of one job never refuse each other; config.yaml written whole."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import yaml

from kiln.config import RunConfig
from kiln.errors import StateError
from kiln.state.rundir import HOLDER, LOCK, config_while_starting, hold_run_dir, started_by, write_config

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}

HOLD = """
import sys
from kiln.state.rundir import hold_run_dir
with hold_run_dir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it (or kills this process)
"""


def test_a_second_process_is_refused_naming_the_holder_and_a_kill_9_blocks_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateError) as refused:
            with hold_run_dir(run_dir):
                pass
        msg = str(refused.value)
        assert f"process {holder.pid} on host {socket.gethostname()}" in msg and "running since" in msg
        assert "train.run_dir" in msg  # what to do
        second = subprocess.run([sys.executable, "-c", HOLD, str(run_dir)], env=ENV, input="", capture_output=True,
                                text=True, timeout=60)  # another real process: refused too
        assert second.returncode != 0 and f"process {holder.pid}" in second.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run_dir / HOLDER).is_file()  # the killed holder could not tidy up, and that blocks nothing:
    with hold_run_dir(run_dir):
        assert json.loads((run_dir / HOLDER).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in run_dir.iterdir()) == []  # released: lock and holder files gone


def test_a_holder_that_ends_normally_leaves_nothing_behind(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.stdin.close()
    assert holder.wait(60) == 0
    assert not (tmp_path / LOCK).exists() and not (tmp_path / HOLDER).exists()


RANKS = r"""
import os, sys
import torch.distributed as dist
from kiln.errors import StateError
from kiln.state.rundir import hold_run_dir
dist.init_process_group("gloo")
rank = dist.get_rank()
free, busy = sys.argv[1], sys.argv[2]
with hold_run_dir(free):  # both ranks of one job: rank 0 holds it, rank 1 is not refused
    dist.barrier()
try:
    with hold_run_dir(busy):  # held by another job: both ranks are refused, neither waits forever
        outcome = "entered"
except StateError as e:
    outcome = "refused: " + str(e)
print(f"rank {rank} {outcome}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_ranks_of_one_job_share_the_directory_and_are_refused_together(tmp_path):
    free, busy = tmp_path / "free", tmp_path / "busy"
    free.mkdir()
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(busy)], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        script = tmp_path / "ranks.py"
        script.write_text(RANKS)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(script), str(free), str(busy)], capture_output=True, text=True, timeout=240,
                              env=ENV)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} refused: {busy} is in use by process {holder.pid}" in done.stdout


def test_write_config_replaces_the_file_whole(tmp_path):
    write_config(tmp_path, RunConfig())
    cfg = RunConfig.model_validate({"train": {"lr": 1e-4}})
    write_config(tmp_path, cfg)
    assert RunConfig.model_validate(yaml.safe_load((tmp_path / "config.yaml").read_text())) == cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "started_in.json"]  # no temporaries left


def test_a_new_run_has_its_config_from_the_start_and_a_clean_failure_takes_it_away(tmp_path):
    cfg = RunConfig()
    with config_while_starting(tmp_path, cfg, writes=True):
        assert (tmp_path / "config.yaml").is_file()  # a kill -9 now leaves it: `kiln train RUN_DIR` resumes
    assert (tmp_path / "config.yaml").is_file()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(KeyboardInterrupt), config_while_starting(other, cfg, writes=True):
        raise KeyboardInterrupt  # a signal during start-up: the directory is left as it was
    assert not (other / "config.yaml").exists()
    with pytest.raises(RuntimeError), config_while_starting(other, cfg, writes=True):
        write_config(other, cfg)  # the run started, and wrote its own
        raise RuntimeError("a crash while training")
    assert (other / "config.yaml").is_file()


def test_the_command_of_a_start_killed_before_it_wrote_its_config_is_told(tmp_path):
    (tmp_path / HOLDER).write_text(json.dumps({"command": "/x/src/kiln/cli.py train my.yaml train.lr=0.1"}))
    assert started_by(tmp_path) == "kiln train my.yaml train.lr=0.1"
    assert started_by(tmp_path / "none") is None


def test_a_run_directory_inside_a_data_source_is_refused(tmp_path, monkeypatch):
    """train.run_dir within a directory of data.sources (or the default runs/ under data.sources=[.]): the first
    start trained, the next read its config.yaml, metrics and checkpoints' JSON as data and stopped on them."""
    from kiln.config import load_config
    from kiln.errors import KilnError
    from kiln.state.resume import run_directory

    data, other = tmp_path / "data", tmp_path / "other"
    data.mkdir(), other.mkdir()
    monkeypatch.chdir(data)
    for run_dir, sources in ((data / "run", [str(data)]), (data, [str(data)]), (None, ["."]),
                             (other / "run", [f"file://{data}", str(tmp_path / "x"), str(other)])):
        cfg = load_config(None, [f"data.sources={sources}".replace("'", "")]
                          + ([f"train.run_dir={run_dir}"] if run_dir else []))
        with pytest.raises(KilnError, match=r"is inside the data source .* Give a run directory outside it"):
            run_directory(cfg, "auto", print)
    assert list(data.iterdir()) == list(other.iterdir()) == []  # nothing made there
    cfg = load_config(None, [f"data.sources=[{data}/*.txt]", f"train.run_dir={data / 'run'}"])  # a glob: some files
    assert run_directory(cfg, "auto", print)[0] == data / "run"


def test_a_users_config_file_in_the_run_directory_is_not_written_over(tmp_path):
    """`kiln train exp/config.yaml train.run_dir=exp` (or `kiln train exp/`) wrote the resolved config over the
    user's file, its comments and layout lost; a config.yaml a start wrote (one killed at once) is resumed."""
    from kiln.config import load_config
    from kiln.errors import ConfigError
    from kiln.state.rundir import check_config_is_a_runs, write_config

    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.yaml").write_text("# my experiment\ntrain: {max_steps: 3}\n")
    with pytest.raises(ConfigError, match=r"exp/config\.yaml is your config file, not one a run wrote"):
        check_config_is_a_runs(exp)
    (exp / "checkpoints").mkdir()  # a run's directory: its config.yaml is the run's to write
    check_config_is_a_runs(exp)
    started = tmp_path / "started"
    started.mkdir()
    write_config(started, load_config(None, ["train.max_steps=3", f"data.cache_dir={tmp_path / 'c'}"]))
    check_config_is_a_runs(started)


def test_an_older_runs_relative_cache_dir_is_read_from_where_the_run_started(tmp_path, monkeypatch):
    """Kiln wrote data.cache_dir as given ('cache') before it wrote it absolute: `kiln train RUN_DIR` from another
    directory read it from there, and prepared the data again into a new cache. It is read from the directory the
    run started in (the run directory's path less its relative train.run_dir), an override still winning."""
    from kiln.state.rundir import run_config

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    old = project / "runs" / "20261101-120000"
    old.mkdir(parents=True)
    saved = yaml.safe_load(RunConfig().to_yaml())
    saved["data"]["cache_dir"], saved["train"]["run_dir"] = "cache", "runs/20261101-120000"
    (old / "config.yaml").write_text(yaml.safe_dump(saved))
    monkeypatch.chdir(elsewhere)
    assert run_config(old).data.cache_dir == str(project / "cache")
    assert run_config(old, ["data.cache_dir=mine"]).data.cache_dir == str(elsewhere / "mine")
    saved["train"]["run_dir"] = str(old)  # absolute: where it started is not known; read as those versions did
    (old / "config.yaml").write_text(yaml.safe_dump(saved))
    assert run_config(old).data.cache_dir == str(elsewhere / "cache")
