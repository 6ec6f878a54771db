"""Whole-job failures under torchrun (gloo, CPU), against a run that was never interrupted. One 2-process run
goes through three interruptions in turn (each torchrun start costs seconds, so they share the run):

- the whole job killed with SIGKILL once a checkpoint exists, then `kiln train RUN_DIR --nproc 2` resumes it;
- SIGTERM to that `kiln train --nproc 2` process alone (as a scheduler sends it): every worker stops at the
  same step with one complete checkpoint;
- resumed under `--max-restarts 1`, one worker killed with SIGKILL: torchrun restarts the job, which resumes
  from the newest checkpoint by itself and finishes with the same losses and final weights as the reference.

Apart from it, a 4-process job killed after its first checkpoint resumes on 2 processes at the same global
sample.

No fixed sleeps: the tests poll the run directory (and /proc for the workers) until what they wait for
is there."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from kiln.state.rundir import checkpoints

from .conftest import losses, stdlib_corpus, tiny_cpu_run

STEPS, EVERY = 40, 5  # steps take ~50 ms, starts seconds: room for 3 interruptions, each after a new checkpoint
ENV = {**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    cache, corpus = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("corpus")
    stdlib_corpus(corpus, 240)
    return [*tiny_cpu_run(cache, corpus, STEPS, EVERY), "checkpoint.keep_last=100", "dist.strategy=fsdp"]


def command(*args: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "kiln.cli", "train", *args, "--nproc", str(nproc),
            *(["--max-restarts", str(max_restarts)] if max_restarts else [])]


def finish(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    done = subprocess.run(command(*args, nproc=nproc), capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def start(logs: Path, *args: str, nproc: int = 2, max_restarts: int = 0) -> subprocess.Popen:
    """`kiln train --nproc` in the background, output to files in the new folder `logs`."""
    logs.mkdir()
    out, err = open(logs / "stdout.txt", "w"), open(logs / "stderr.txt", "w")
    return subprocess.Popen(command(*args, nproc=nproc, max_restarts=max_restarts), stdout=out, stderr=err, env=ENV)


def output(logs: Path) -> str:
    return (logs / "stdout.txt").read_text() + (logs / "stderr.txt").read_text()


def wait_until(what, proc: subprocess.Popen, logs: Path, timeout: float = 240):
    """Poll `what()` until it gives something true; fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        assert proc.poll() is None, f"the job ended (code {proc.returncode}) first:\n{output(logs)[-3000:]}"
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting:\n{output(logs)[-3000:]}")


def steps_saved(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in checkpoints(run_dir)]


def descendants(root: int) -> list[int]:
    """Every process below `root`, parents before children (torchrun starts its workers in sessions of their own)."""
    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def worker(root: int, rank: int) -> int | None:
    """The pid of the training process of `rank` below `root` (None until it runs)."""
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        launcher = b"torch.distributed.run" in cmdline or b"kiln.parallel.launch.torchrun" in cmdline
        if f"RANK={rank}".encode() in env and b"kiln.cli" in cmdline and not launcher:
            return pid
    return None


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL every process of the job at once, as a lost machine would stop them."""
    for pid in [*reversed(descendants(job.pid)), job.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(timeout=60)


def same_weights(a: Path, b: Path) -> None:
    from kiln.state.weights import load_model

    ma, _ = load_model(a)
    mb, _ = load_model(b)
    for (k, va), (_, vb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(va, vb), k


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> Path:
    """2 processes, 2 sequences each, never interrupted."""
    run_dir = tmp_path_factory.mktemp("runs") / "reference"
    finish(*base, "train.batch_size=2", f"train.run_dir={run_dir}")
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return run_dir


def killed_early(run_dir: Path) -> None:
    """The job was stopped before it finished (else the test would prove nothing)."""
    assert not (run_dir / "model").exists() and max(steps_saved(run_dir)) < STEPS


def newer_checkpoint(run_dir: Path, than: int):
    """A test for wait_until: the newest saved step once it is past `than`."""
    return lambda: max(steps_saved(run_dir), default=0) > than and max(steps_saved(run_dir))


@pytest.mark.slow
def test_sigkill_sigterm_and_a_killed_worker_in_turn_then_the_run_ends_as_if_never_stopped(base, reference, tmp_path):
    run_dir = tmp_path / "run"

    # 1. SIGKILL of the whole job once a checkpoint exists; `kiln train RUN_DIR` resumes it
    job = start(tmp_path / "1", *base, "train.batch_size=2", f"train.run_dir={run_dir}")
    wait_until(lambda: steps_saved(run_dir), job, tmp_path / "1")
    kill_job(job)  # kiln, torchrun and its workers: all at once
    killed_early(run_dir)
    killed_at = max(steps_saved(run_dir))

    # 2. SIGTERM to the launcher of the resumed job, once it saved a checkpoint of its own
    job = start(tmp_path / "2", str(run_dir))
    wait_until(newer_checkpoint(run_dir, killed_at), job, tmp_path / "2")
    job.send_signal(signal.SIGTERM)  # the launcher alone: torchrun and the workers hear it from it
    job.wait(timeout=120)
    out = output(tmp_path / "2")
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{killed_at:08d}'}" in out
    killed_early(run_dir)
    metas = [json.loads((p / "meta.json").read_text()) for p in checkpoints(run_dir)]
    preempt = [m for m in metas if m["reason"] == "preempt"]
    assert len(preempt) == 1 and preempt[0] == metas[-1] and preempt[0]["world_size"] == 2, out[-3000:]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]  # nothing half-written
    assert f"stopped by SIGTERM after step {preempt[0]['step']}" in out
    assert "forcefully exiting via SIGKILL" not in out  # every worker finished within torchrun's grace
    stopped_at = preempt[0]["step"]

    # 3. resumed under --max-restarts 1; a worker killed after a new checkpoint: torchrun restarts the job,
    # which resumes from the newest checkpoint by itself and finishes
    job = start(tmp_path / "3", str(run_dir), max_restarts=1)
    newest = wait_until(newer_checkpoint(run_dir, stopped_at), job, tmp_path / "3")
    victim = wait_until(lambda: worker(job.pid, 1), job, tmp_path / "3")
    os.kill(victim, signal.SIGKILL)
    assert job.wait(timeout=300) == 0, output(tmp_path / "3")[-4000:]
    out = output(tmp_path / "3")
    assert "(exitcode: -9)" in out and out.count("kiln run directory:") == 2  # torchrun started the job again
    resumed = [int(line.split("(step ")[1].split(",")[0]) for line in out.splitlines() if "resumed from" in line]
    assert resumed[0] == stopped_at and len(resumed) == 2 and resumed[1] >= newest  # by itself, from the newest
    assert losses(run_dir) == losses(reference)
    same_weights(run_dir, reference)


@pytest.mark.slow
def test_a_four_process_job_resumes_on_two_at_the_same_global_sample(base, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = start(tmp_path / "logs", *base, "train.batch_size=1", f"train.run_dir={run_dir}", nproc=4)  # 4 x 1
    wait_until(lambda: steps_saved(run_dir), job, tmp_path / "logs")
    kill_job(job)
    killed_early(run_dir)
    saved = max(steps_saved(run_dir))
    out = finish(str(run_dir), "train.batch_size=2")  # 2 x 2 sequences: the same global batch
    assert "elastic resume: 4 -> 2 process(es)" in out.stdout
    got, expected = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([expected[s] for s in sorted(got)], rel=1e-4)
    assert saved < STEPS


def launcher(root: int) -> int | None:
    """The pid of the torchrun process below `root`."""
    for pid in descendants(root):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"kiln.parallel.launch.torchrun" in f.read():
                return pid
    return None


def preempt_saves(run_dir: Path) -> list[dict]:
    metas = [json.loads((p / "meta.json").read_text()) for p in checkpoints(run_dir)]
    return [m for m in metas if m["reason"] == "preempt"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("victim", ["kiln", "torchrun"])
def test_workers_whose_launcher_is_killed_write_a_checkpoint_and_stop(base, tmp_path, victim):
    """SIGKILL to `kiln train --nproc` (torchrun is told with SIGTERM) or to torchrun (its workers are): the
    workers neither train on nor hold the run, its GPUs and its lock: they save, stop, and the run resumes; that
    resumed job, sent SIGHUP through its torchrun, saves and stops in turn (sighup_to_torchrun)."""
    run_dir = tmp_path / "run"
    job = start(tmp_path / "1", *base, "train.batch_size=2", f"train.run_dir={run_dir}")
    wait_until(lambda: steps_saved(run_dir), job, tmp_path / "1")
    workers = [wait_until(lambda r=r: worker(job.pid, r), job, tmp_path / "1") for r in (0, 1)]
    agent = launcher(job.pid)
    os.kill(job.pid if victim == "kiln" else agent, signal.SIGKILL)
    job.wait(timeout=60)
    for pid in [*workers, agent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=120)  # else psutil.TimeoutExpired: it trains on
    out = output(tmp_path / "1")
    killed_early(run_dir)
    saves = preempt_saves(run_dir)
    assert len(saves) == 1 and saves[0]["world_size"] == 2, out[-3000:]
    assert f"stopped by SIGTERM after step {saves[0]['step']}" in out
    if victim == "kiln":
        return  # the workers stopped as under a scheduler's SIGTERM, whose resume test_sigkill_sigterm_... checks
    assert job.returncode == 128 + signal.SIGKILL and "torchrun was killed by SIGKILL" in out
    # the lock is free: the run resumes from the workers' checkpoint (the job is then stopped as in sighup_to_torchrun)
    saved = run_dir / "checkpoints" / f"step_{saves[0]['step']:08d}"
    out = sighup_to_torchrun(tmp_path / "2", run_dir, str(run_dir), after=saves[0]["step"])
    assert f"resumed from {saved}" in out


def sighup_to_torchrun(logs: Path, run_dir: Path, *args: str, after: int = 0) -> str:
    """torchrun passes the SIGHUP of a closed terminal to the workers, which died of it with no checkpoint. The job
    `kiln train ARGS --nproc 2`, SIGHUP to its torchrun once it saved a step past `after`: its output."""
    job = start(logs, *args)
    wait_until(lambda: newer_checkpoint(run_dir, after)() and worker(job.pid, 1), job, logs)
    os.kill(launcher(job.pid), signal.SIGHUP)
    assert job.wait(timeout=120) == 128 + signal.SIGHUP
    out = output(logs)
    killed_early(run_dir)
    saves = [m for m in preempt_saves(run_dir) if m["step"] > after]
    assert len(saves) == 1 and saves[0]["world_size"] == 2, out[-3000:]
    assert f"stopped by SIGHUP after step {saves[0]['step']}" in out and "kiln: the job stopped on SIGHUP" in out
    assert f"Resume with: kiln train {run_dir} --nproc 2\n" in out  # on 2 processes, as it ran
    return out


@pytest.mark.slow
def test_ctrl_c_to_a_job_piped_to_tee_writes_a_checkpoint_and_stops(base, tmp_path):
    """`kiln train --nproc 2 ... 2>&1 | tee log` and Ctrl-C (SIGINT to the pipeline's process group): tee exits
    at once, and the job's next writes to the pipe raised BrokenPipeError, so no checkpoint was written."""
    import shlex

    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "stderr.txt").write_text("")
    line = shlex.join(command(*base, "train.batch_size=2", f"train.run_dir={run_dir}"))
    line += f" 2>&1 | tee {logs}/stdout.txt"
    job = subprocess.Popen(["bash", "-c", line], env=ENV, start_new_session=True, stdout=subprocess.DEVNULL)
    wait_until(lambda: steps_saved(run_dir) and worker(job.pid, 1), job, logs)
    everyone = [job.pid, *descendants(job.pid)]
    os.killpg(job.pid, signal.SIGINT)  # Ctrl-C: bash, kiln, tee and torchrun (the workers have their own sessions)
    job.wait(timeout=120)
    for pid in everyone:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=120)
    killed_early(run_dir)
    saves = preempt_saves(run_dir)
    assert len(saves) == 1 and saves[0]["world_size"] == 2


@pytest.mark.slow
def test_ctrl_z_leaves_the_job_running_and_says_why(base, tmp_path):
    """Ctrl-Z (SIGTSTP to the terminal's process group: kiln and torchrun; the workers have sessions of their own)
    stopped kiln and torchrun and left the workers training unwatched. Now nothing stops, torchrun says why, and
    the job finishes."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    out, err = open(logs / "stdout.txt", "w"), open(logs / "stderr.txt", "w")
    # a process group of its own in this session, as a shell makes for a job (in a session of its own, the group
    # would be orphaned, and the kernel drops SIGTSTP for it)
    job = subprocess.Popen(command(*base, f"train.run_dir={run_dir}"), stdout=out, stderr=err, env=ENV,
                           preexec_fn=os.setpgrp)
    try:
        wait_until(lambda: worker(job.pid, 1), job, logs)
        os.killpg(job.pid, signal.SIGTSTP)
        assert job.wait(timeout=90) == 0, output(logs)[-3000:]
    finally:
        if job.poll() is None:
            kill_job(job)
    assert "Ctrl-Z does not pause a job of several processes" in output(logs)
    assert len(losses(run_dir)) >= STEPS // 5  # it trained to the end
