"""`kiln train` and its run directory, with real processes and signals: one run at a time in a
directory, config.yaml replaced only by a start or resume that succeeded, a finished run left as it
is, the final model save finished despite a Ctrl-C, and clean exits for signals during start-up.

Each child announces where it waits on stdout and waits for a file the test creates: no sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import kiln_here, stdlib_corpus, tiny_cpu_run

pytestmark = pytest.mark.slow

ENV = {**os.environ, "COLUMNS": "400", "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}

# argv: ACTION GO_FILE kiln-train-args...; prints a line and waits for GO_FILE where ACTION says, then goes on
CHILD = r'''
import sys, time
from pathlib import Path
action, go = sys.argv[1], Path(sys.argv[2])
sys.argv = ["kiln", "train", *sys.argv[3:]]

def wait(what, go=go):
    print(what, flush=True)
    while not go.exists():
        time.sleep(0.01)

import kiln.train.run as r
if action == "hold":  # after the checkpoint of step 2 is complete
    class Paused(r.CheckpointEvery):
        def on_step_end(self, trainer, metrics):
            super().on_step_end(trainer, metrics)
            if trainer.step == 2:
                self.ckpt.wait()
                wait("held")
    r.CheckpointEvery = Paused
if action == "startup":  # inside data preparation, with the tokenizer workers started
    import kiln.data.prepare.encode as e
    import kiln.data.prepare.pipeline as p
    p.POOL_MIN_BYTES = 0
    submit = e.Encoder.submit
    def waiting(self, *a, **k):
        if self.pool is not None:
            wait("encoding")
        return submit(self, *a, **k)
    e.Encoder.submit = waiting
if action.startswith("save"):  # at the start of the final model save
    save = r.save_model
    def slow(*a, **k):
        wait("saving")
        return save(*a, **k)
    r.save_model = slow
if action.endswith("+end"):  # as the process ends, after the run (GO_FILE.end)
    run = r.run
    def ending(*a, **k):
        out = run(*a, **k)
        wait("ending", go.with_suffix(".end"))
        return out
    r.run = ending
from kiln.cli import main

main()
'''


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    cache, corpus = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("corpus")
    stdlib_corpus(corpus, 120)
    return tiny_cpu_run(cache, corpus, 4, 2, "train.warmup_steps=1", "checkpoint.async_save=false", "data.workers=2",
                        batch_size=4, vocab_size=300)


def kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, env=ENV)


def child(action: str, go: Path, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, action, str(go), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)


def wait_for(stream, line: str) -> str:
    """What `stream` gives up to the first line that is or holds `line`."""
    seen = []
    for got in stream:
        seen.append(got)
        if got.strip() == line or line in got:
            return "".join(seen)
    raise AssertionError(f"the child ended before printing {line!r}:\n{''.join(seen)[-3000:]}")


def files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run directory outside checkpoints/, with its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and "checkpoints" not in p.parts}


def test_a_second_run_is_refused_and_a_killed_holder_blocks_no_resume(base, tmp_path):
    run_dir = tmp_path / "run"
    holder = child("hold", tmp_path / "go", [*base, f"train.run_dir={run_dir}"])
    try:
        wait_for(holder.stdout, "held")
        second = kiln_here("train", str(run_dir))  # refused before it trains: in this process
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by process {holder.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]  # untouched
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    again = kiln_here("train", str(run_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'}" in again.stdout
    assert not (run_dir / ".lock").exists() and not (run_dir / ".lock-holder.json").exists()


def test_a_run_stopped_by_sigterm_in_training_checkpoints_and_exits_143(base, tmp_path):
    """Not finished: 128 + the signal, as `kiln train --nproc` exits, so a scheduler that restarts failed jobs
    resumes it (exit 0 marked a preempted Kubernetes job done)."""
    run_dir = tmp_path / "run"
    stopped = child("hold", tmp_path / "go", [*base, f"train.run_dir={run_dir}"])
    wait_for(stopped.stdout, "held")  # at the end of step 2
    os.killpg(stopped.pid, signal.SIGTERM)
    wait_for(stopped.stderr, "SIGTERM received")
    (tmp_path / "go").touch()
    out, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, err[-3000:]
    # the guard stops at the end of the step after the signal's
    assert "stopped by SIGTERM after step 3" in out and f"Resume with: kiln train {run_dir}" in out
    assert (run_dir / "checkpoints" / "step_00000003" / "meta.json").is_file()
    assert "Traceback" not in err and not (run_dir / ".lock").exists()


def test_a_finished_run_is_left_as_it_is_and_a_failed_force_keeps_the_config(base, tmp_path):
    run_dir = tmp_path / "run"
    first = kiln_here("train", *base, f"train.run_dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    before = files(run_dir)
    assert "config.yaml" in before and "model/model.safetensors" in before and "metrics.jsonl" in before

    # the calls that need no process of their own run in this process (kiln_here): a new interpreter adds nothing
    again = kiln_here("train", str(run_dir))  # finished: says so, changes nothing (no second eval record, no new save)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run has finished" in again.stdout and "train.max_steps" in again.stdout
    assert files(run_dir) == before

    forced = kiln_here("train", str(run_dir), "model.n_layers=3", "train.max_steps=6", "--resume", "force")
    assert forced.returncode == 2 and "does not fit this model" in forced.stderr, forced.stderr[-3000:]
    assert files(run_dir) == before  # config.yaml still the one the checkpoints were written with
    plain = kiln_here("train", str(run_dir))
    assert plain.returncode == 0 and "this run has finished" in plain.stdout, plain.stderr[-3000:]

    longer = kiln_here("train", str(run_dir), "train.max_steps=6", "--resume", "force")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"] == 6
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_during_the_final_save_finishes_it_and_twice_aborts_it(base, tmp_path):
    run_dir = tmp_path / "run"
    once = child("save+end", tmp_path / "go", [*base, f"train.run_dir={run_dir}"])
    wait_for(once.stdout, "saving")
    os.killpg(once.pid, signal.SIGINT)
    wait_for(once.stderr, "finishing the model save first")
    (tmp_path / "go").touch()
    out = wait_for(once.stdout, "ending")  # saved: a Ctrl-C as the process ends loses nothing, and says so
    os.killpg(once.pid, signal.SIGINT)
    wait_for(once.stderr, "after the run was saved: nothing is lost")
    (tmp_path / "go.end").touch()
    rest, err = once.communicate(timeout=300)
    out += rest
    assert once.returncode == 0, err[-3000:]
    assert "model saved" in out and "stopped by SIGINT after the model save" in out
    assert (run_dir / "model" / "model.safetensors").is_file() and "Traceback" not in err
    assert "interrupted" not in err

    run_dir = tmp_path / "run2"
    twice = child("save", tmp_path / "go2", [*base, f"train.run_dir={run_dir}"])
    wait_for(twice.stdout, "saving")
    os.killpg(twice.pid, signal.SIGINT)
    wait_for(twice.stderr, "finishing the model save first")
    os.killpg(twice.pid, signal.SIGINT)
    out, err = twice.communicate(timeout=300)
    assert twice.returncode == 130, err[-3000:]
    assert f"second SIGINT during the final model save: model/ is incomplete; the final checkpoint is complete " \
           f"and `kiln train {run_dir}` writes model/ from it" in err
    assert "Traceback" not in err and not (run_dir / "model" / "model.safetensors").exists()
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    written = kiln_here("train", str(run_dir))  # as the message says: model/ written from the final checkpoint
    assert written.returncode == 0, written.stderr[-3000:]
    assert "its model was not saved: writing it now" in written.stdout
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # no second evaluation record


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_exits_cleanly_and_releases_the_run_dir(base, tmp_path, sig):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"  # a cache of its own: the data is prepared here
    starting = child("startup", tmp_path / "go", [*base, f"train.run_dir={run_dir}", f"data.cache_dir={cache}"])
    wait_for(starting.stdout, "encoding")
    os.killpg(starting.pid, sig)  # as Ctrl-C or a scheduler does: to the whole group, workers included
    out, err = starting.communicate(timeout=120)
    assert starting.returncode == 128 + sig, err[-3000:]
    assert f"{signal.Signals(sig).name} during start-up: stopped before training" in err
    assert "Traceback" not in err + out
    assert not run_dir.exists()  # no lock left, no config.yaml of a run never started: the directory it made, gone


def test_a_start_killed_in_its_first_seconds_is_resumed_by_kiln_train_run_dir(base, tmp_path):
    """kill -9 during start-up (data preparation): `kiln train RUN_DIR` said 'a directory without config.yaml',
    though the original command resumed."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    starting = child("startup", tmp_path / "go", [*base, f"train.run_dir={run_dir}", f"data.cache_dir={cache}"])
    wait_for(starting.stdout, "encoding")
    os.killpg(starting.pid, signal.SIGKILL)
    starting.wait()
    again = kiln(str(run_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert (run_dir / "model" / "model.safetensors").is_file()


def test_checkpoints_that_missed_the_archive_as_the_run_ended_are_archived_by_kiln_train_run_dir(base, tmp_path):
    """With the archive failing to the end, the run said they 'are archived when this run is resumed'; with the
    archive back, `kiln train R` said 'this run has finished ... nothing to do' and archived nothing."""
    run_dir, archive = tmp_path / "run", tmp_path / "archive"
    archive.write_text("not a directory")  # the archive fails throughout (root ignores a read-only chmod)
    first = kiln_here("train", *base, f"train.run_dir={run_dir}", f"checkpoint.archive_url={archive}",
                      "checkpoint.archive_every=1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"archived when `kiln train {run_dir}` is run again" in first.stdout + first.stderr
    archive.unlink()  # the archive works again
    again = kiln_here("train", str(run_dir))  # finished: archives and ends before training, in this process
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run has finished" in again.stdout
    assert f"archived 2 checkpoint(s) that missed the archive {archive} when this run ended: step_00000002, " \
           "step_00000004" in again.stdout, again.stdout[-3000:]
    assert sorted(p.name for p in (archive / run_dir.name).iterdir() if p.name.startswith("step_")) == \
        ["step_00000002", "step_00000004"]
