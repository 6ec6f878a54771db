"""Under torchrun with 2 processes: a rank that raises stops both at once with its error shown once, naming
it; a rank that hangs is named by the watchdog (dist.watchdog_s) with the stacks of its threads; a rank stopped
(SIGSTOP) or killed (SIGKILL) in a job started as users do (`kiln train --nproc 2`) is named, with how."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import kiln_here, stdlib_corpus

CHILD = r'''
import os, sys, threading
from kiln.config import load_config
from kiln.train.events import Callback
from kiln.train.run import run


action = sys.argv[1]

class Fault(Callback):
    def on_step_end(self, trainer, metrics):
        if trainer.step == 3 and os.environ["RANK"] == "1":
            if action == "raise":
                raise RuntimeError("injected failure")
            threading.Event().wait()  # hang: stuck forever, as in a dead file system

if action == "signal_in_gather":  # SIGTERM to every rank as the final model is gathered
    import signal
    import kiln.train.run as train_run

    gather = train_run.full_model
    def full_model(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        return gather(*a)
    train_run.full_model = full_model

if action == "signal_at_end":  # SIGTERM to rank 1 as it waits for rank 0 to finish the run (model/ save)
    import signal
    from kiln.parallel.mesh import Mesh

    close = Mesh.close
    def close_at_signal(self, clean=False):
        if clean and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGTERM)
        return close(self, clean)
    Mesh.close = close_at_signal

run(load_config(None, sys.argv[2:]), callbacks=[Fault()] if action in ("raise", "hang") else [])
'''


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> list[str]:
    cache, corpus = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("corpus")
    stdlib_corpus(corpus, 60, modules=20)
    return ["model.size=tiny", "train.seq_len=32", "train.batch_size=2", "train.max_steps=40", "train.eval_every=0",
            "train.eval_batches=1", "train.sample_tokens=0", "train.device=cpu", "checkpoint.every=0",
            "checkpoint.save_final=false", "logging.console=false", "logging.plots=false", f"data.sources=[{corpus}]",
            "data.val_fraction=0.1", "data.vocab_size=300", f"data.cache_dir={cache}", "dist.strategy=ddp"]


def torchrun(tmp_path: Path, action: str, args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), action,
           *args, f"train.run_dir={tmp_path / 'run'}"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"})
    return done, time.monotonic() - t0


@pytest.mark.slow
def test_a_rank_that_raises_stops_every_rank_with_one_error(tmp_path, args):
    done, _ = torchrun(tmp_path, "raise", [*args, "dist.timeout_s=600"])
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("RuntimeError: injected failure") == 1, out[-4000:]  # once, from rank 1
    said = "rank 0: stopping, because rank 1 failed (its error follows)"
    assert said in done.stderr and done.stderr.index(said) < done.stderr.index("RuntimeError: injected failure")
    assert "Connection closed by peer" not in out  # rank 0 gives no secondary error


@pytest.mark.slow
def test_the_watchdog_names_a_hung_rank_and_shows_its_stacks(tmp_path, args):
    done, seconds = torchrun(tmp_path, "hang", [*args, "dist.watchdog_s=3", "dist.timeout_s=600"])
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "kiln watchdog: rank 1 made no progress for 3 s" in out and "stuck rank(s): 1" in out, out[-4000:]
    assert "in on_step_end" in out  # the stack of the hung thread, where it hangs
    assert "Connection closed by peer" not in out  # rank 0 gives no secondary error
    assert seconds < 200  # long before the 600 s collective timeout


def test_a_config_error_under_kiln_train_nproc_is_printed_once_before_any_process_starts(tmp_path):
    """kiln train --nproc checks the config before it starts torchrun: a bad one is one message, exit code 2,
    and no process is started (nor restarted, with --max-restarts)."""
    cmd = [sys.executable, "-m", "kiln.cli", "train", "quickstart", "train.lr=abc", f"train.run_dir={tmp_path}/run",
           "--nproc", "2", "--max-restarts", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count("train.lr: Input should be a valid number") == 1, out[-3000:]
    assert "rank" not in out and "torchelastic" not in out and "Traceback" not in out, out[-3000:]
    assert done.stderr.strip().splitlines()[-1].strip().startswith("- train.lr: Input should be a valid number")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_config_error_under_plain_torchrun_is_printed_by_the_first_process_alone(tmp_path):
    """Under torchrun started by the user, each process reads the bad config; rank 0 alone prints it (torchrun's
    own summary then names it as the root cause) and rank 1 waits quietly to be stopped."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "kiln.cli", "train",
           "quickstart", "train.lr=abc", f"train.run_dir={tmp_path}/run"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"})
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    printed = [line for line in out.splitlines() if line.startswith("error (rank 0): 1 problem(s) in the config")]
    assert len(printed) == 1, out[-3000:]
    assert "error (rank 1)" not in out
    assert "traceback : error (rank 0)" in out  # torchrun's summary shows the message as the root cause


@pytest.mark.slow
def test_a_signal_while_the_final_model_is_gathered_says_so_and_how_to_write_the_model(tmp_path, args):
    done, _ = torchrun(tmp_path, "signal_in_gather", [*args, "checkpoint.save_final=true", "train.max_steps=4"])
    out = done.stdout + done.stderr
    assert done.returncode != 0 and not (tmp_path / "run" / "model").exists()
    assert (f"SIGTERM while gathering the final model: training is complete; `kiln train {tmp_path / 'run'}` "
            "writes model/ from its final checkpoint") in out, out[-4000:]
    again = kiln_here("train", str(tmp_path / "run"))  # as it says; it writes model/, trains nothing: in-process
    assert again.returncode == 0 and "writing it now" in again.stdout, again.stderr[-3000:]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_an_error_found_after_start_up_is_not_restarted_under_max_restarts(tmp_path, args):
    """model.vocab_size below the tokenizer's is found once the data is prepared, in every process: under
    --max-restarts 2 the job started three times, each ending with the same error."""
    cmd = [sys.executable, "-m", "kiln.cli", "train", *args, "model.vocab_size=100", f"train.run_dir={tmp_path}/run",
           "--nproc", "2", "--max-restarts", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count("is smaller than the tokenizer's") == 1 and out.count("kiln run directory:") == 1, out[-3000:]
    assert "kiln: not restarting the job: rank" in out


@pytest.mark.slow
def test_a_signal_to_a_rank_waiting_for_the_others_at_the_end_does_not_break_the_complete_run(tmp_path, args):
    """Rank 1, done, waits for rank 0 to save model/ and leave the group with it; a SIGTERM then killed it, and
    rank 0's wait failed with a traceback ('Connection closed by peer') though the run was complete."""
    done, _ = torchrun(tmp_path, "signal_at_end", [*args, "checkpoint.save_final=true", "train.max_steps=4"])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Connection closed by peer" not in out and "Traceback" not in out, out[-4000:]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def signalled(tmp_path: Path, args: list[str], rank: int, signum: int) -> tuple[int, str]:
    """`kiln train ARGS --nproc 2` as a user starts it; once it trains, `signum` to rank `rank`'s process. The exit
    code and output (every process is stopped within the bounds, whatever happens)."""
    import psutil

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "kiln.cli", "train", *args, "train.max_steps=100000", "logging.every=1",
           f"train.run_dir={run_dir}", "--nproc", "2"]
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"})
    try:
        deadline = time.monotonic() + 240  # start-up and data preparation on a loaded machine
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"event": "train"') >= 3):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        worker = next(p for p in psutil.Process(job.pid).children(recursive=True)
                      if p.environ().get("RANK") == str(rank) and "kiln.cli" in " ".join(p.cmdline()))
        worker.send_signal(signum)
        code = job.wait(timeout=180)  # well below torch's 30-minute default, and dist.timeout_s=600
    finally:
        if job.poll() is None:
            for p in psutil.Process(job.pid).children(recursive=True):
                p.send_signal(signal.SIGCONT)
                p.kill()
            job.kill()
            job.wait()
    return code, log.read_text()


@pytest.mark.slow
def test_a_stopped_rank_0_which_serves_the_store_is_named_by_the_watchdog(tmp_path, args):
    """kill -STOP of rank 0 under FSDP with dist.watchdog_s=10: nothing was printed, and the job still hung 400 s
    on: the watchdog kept its counts in the store rank 0 serves, and its thread died when the store stopped
    answering."""
    code, out = signalled(tmp_path, [*args, "dist.strategy=fsdp", "dist.watchdog_s=5", "dist.timeout_s=600"], 0,
                          signal.SIGSTOP)
    assert code == 124, out[-4000:]  # as timeout(1): a hang
    assert "kiln watchdog (rank 1): rank 0 hung: it stopped answering: the job's key-value store, which it serves, " \
           "has not answered" in out, out[-4000:]
    assert "is stopped (SIGSTOP, SIGTSTP or Ctrl-Z" in out and "Thread MainThread" in out  # what it can get
    assert out.strip().splitlines()[-1] == "kiln: the job stopped: rank 0 hung (exit code 124); rank 1's report is " \
                                           "above"
    assert "Traceback" not in out


@pytest.mark.slow
def test_a_stopped_rank_1_is_named_with_how_long_and_the_stacks_of_the_rank_that_waits_for_it(tmp_path, args):
    """kill -STOP of rank 1 under DDP: the only line was 'rank 0: stopping, because rank 1 failed (its error
    follows)', no error followed, and torchrun's summary named rank 0 as the root cause."""
    code, out = signalled(tmp_path, [*args, "dist.watchdog_s=5", "dist.timeout_s=600"], 1, signal.SIGSTOP)
    assert code == 124, out[-4000:]
    assert "kiln watchdog (rank 0): rank 1 hung: it stopped answering: no heartbeat from it for" in out, out[-4000:]
    assert "rank 0 has made no progress for" in out and "Stacks of rank 0's threads, waiting for rank 1" in out
    assert "rank 1 failed" not in out and "Traceback" not in out
    assert out.strip().splitlines()[-1] == "kiln: the job stopped: rank 1 hung (exit code 124); rank 0's report is " \
                                           "above"


@pytest.mark.slow
def test_without_the_watchdog_a_stopped_rank_ends_the_job_at_the_collective_timeout_naming_it(tmp_path, args):
    """With dist.timeout_s=60 and no watchdog the job still hung at 400 s (the store calls of the failing rank
    waited on the stopped one forever)."""
    code, out = signalled(tmp_path, [*args, "dist.strategy=fsdp", "dist.timeout_s=10"], 0, signal.SIGSTOP)
    assert code == 124, out[-4000:]
    assert "rank 1: stopping, because rank 0 hung (dist.timeout_s): a collective of rank 1 timed out waiting for " \
           "it" in out, out[-4000:]
    assert "Traceback" not in out


@pytest.mark.slow
def test_a_killed_rank_is_named_at_once_with_the_signal_and_no_traceback(tmp_path, args):
    """kill -9 of rank 1 under DDP: rank 0 said 'SIGTERM received: ... writing a checkpoint' (none came) and printed
    a 70-line gloo traceback; the dead rank appeared only in torchrun's final table."""
    code, out = signalled(tmp_path, args, 1, signal.SIGKILL)
    assert code == 137, out[-4000:]  # 128 + SIGKILL, as a shell says
    assert "kiln: rank 1 (pid " in out and ") was killed by SIGKILL" in out, out[-4000:]
    assert "rank 0: stopping, because rank 1 (pid" in out
    assert "Traceback" not in out and "writing a checkpoint" not in out and "Connection reset" not in out


@pytest.mark.slow
def test_a_watchdog_shorter_than_the_final_sample_leaves_a_finished_run_alone(tmp_path, args):
    """Rank 0 samples alone at the end while rank 1 waits: with dist.watchdog_s=2 the finished run exited 124. At
    dist.watchdog_s=1 a verdict would come about 4 s into the sample (Watch.frozen_min_s of heartbeats first):
    1,500 tokens take about twice that."""
    cmd = [sys.executable, "-m", "kiln.cli", "train", *args, "train.max_steps=10", "train.sample_tokens=1500",
           "train.sample_ignore_eos=true",
           "dist.watchdog_s=1", f"train.run_dir={tmp_path / 'run'}", "--nproc", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "kiln watchdog" not in done.stderr and " hung" not in done.stderr
