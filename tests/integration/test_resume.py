"""Exact resume, end to end: a run killed with SIGKILL (between checkpoints or in the middle of a
save), stopped by SIGTERM, or crashed, then resumed with `kiln train RUN_DIR`, logs the very same
per-step losses as a run that never stopped. CPU, the same thread count in every process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import kiln_here, stdlib_corpus, tiny_cpu_run

pytestmark = pytest.mark.slow  # each test trains in subprocesses, several times

N, K = 6, 2  # checkpoint every N steps; interruptions come K steps after one
ENV = {**os.environ, "COLUMNS": "400"}  # no console line wrapping inside paths

CHILD = r'''
import os, signal, sys
from kiln.config import load_config
from kiln.state.callback import CheckpointEvery
from kiln.train.events import Callback
from kiln.train.run import run


action, at, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

class Interrupt(Callback):
    def on_step_end(self, trainer, metrics):
        if trainer.step != at:
            return
        if action == "kill":  # once the previous checkpoint is complete, die between checkpoints
            next(cb for cb in trainer.events.callbacks if isinstance(cb, CheckpointEvery)).ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if action in ("term", "term2"):
            os.kill(os.getpid(), signal.SIGTERM)
        if action == "term2":
            os.kill(os.getpid(), signal.SIGTERM)
        if action == "crash":
            raise RuntimeError("injected failure")

if action == "killsave":  # SIGKILL while the checkpoint of step `at` is being written
    import kiln.state.checkpointer as c
    hash_tree = c.hash_tree
    def dying(root, *args, **kwargs):
        if root.name.endswith(f"step_{at:08d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return hash_tree(root, *args, **kwargs)
    c.hash_tree = dying
run(load_config(None, args), callbacks=[Interrupt()])
'''


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    cache, corpus = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("corpus")
    stdlib_corpus(corpus, 240)
    return tiny_cpu_run(cache, corpus, 2 * N, N, "checkpoint.save_final=false", batch_size=4)


def train(args: list[str], action: str = "none", at: int = 0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, action, str(at), *args], capture_output=True, text=True,
                          timeout=300, env=ENV, cwd=cwd)


def resume(run_dir: Path, *extra: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`kiln train RUN_DIR EXTRA` in this process (kiln_here), run from `cwd`: a new interpreter added seconds of
    imports; the losses it logs are the same, bit for bit, as the thread count is."""
    with contextlib.chdir(cwd or Path.cwd()):
        return kiln_here("train", str(run_dir), *extra)


def losses(run_dir: Path) -> tuple[dict[int, float], dict[int, int]]:
    """Last logged loss of each step, and how many times each step was logged."""
    last, count = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by SIGKILL
            continue
        if rec.get("event") == "train":
            last[rec["step"]] = rec["loss"]
            count[rec["step"]] = count.get(rec["step"], 0) + 1
    return last, count


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("a") / "run"
    done = train([*base, f"train.run_dir={run_dir}"])
    assert done.returncode == 0, done.stderr
    ref, _ = losses(run_dir)
    assert sorted(ref) == list(range(1, 2 * N + 1))
    return ref


def test_sigkill_between_checkpoints_resumes_bit_for_bit(base, reference, tmp_path):
    """Started with its data.sources relative to the directory it ran in, resumed from another directory: the
    sources are read from the first (it stopped on the files missing, or could read others of the same name)."""
    run_dir = tmp_path / "run"
    corpus = Path(next(a for a in base if a.startswith("data.sources=")).partition("=")[2].strip("[]"))
    killed = train([*base, f"train.run_dir={run_dir}", f"data.sources=[{corpus.name}]"], "kill", N + K,
                   cwd=corpus.parent)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{N:08d}"]
    again = resume(run_dir, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{N:08d}'}" in again.stdout
    got, count = losses(run_dir)
    assert got == reference  # every step, bit for bit
    assert set(count.values()) == {1}  # the replayed steps' old records were dropped: each step once


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(base, reference, tmp_path):
    run_dir = tmp_path / "run"
    half = N // 2
    killed = train([*base, f"train.run_dir={run_dir}", f"checkpoint.every={half}"], "killsave", N)
    assert killed.returncode == -signal.SIGKILL
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [f".tmp-step_{N:08d}", f"step_{half:08d}"]  # the half-written one is not a checkpoint
    again = resume(run_dir)
    assert again.returncode == 0, again.stderr
    out = again.stdout
    assert "never completed" in out and f"step_{half:08d} (step {half}," in out
    assert losses(run_dir)[0] == reference


def test_sigterm_writes_a_checkpoint_and_exits_zero(base, reference, tmp_path):
    run_dir = tmp_path / "run"
    stopped = train([*base, f"train.run_dir={run_dir}"], "term", N + K)
    assert stopped.returncode == 0, stopped.stderr
    assert "Resume with: kiln train" in stopped.stdout
    meta = json.loads((run_dir / "checkpoints" / f"step_{N + K:08d}" / "meta.json").read_text())
    assert meta["reason"] == "preempt" and meta["step"] == N + K
    again = resume(run_dir)
    assert again.returncode == 0, again.stderr
    assert losses(run_dir)[0] == reference
    # with no console, train.log holds each process's progress, its checkpoints, the stop and the resume
    said = [line[21:].split("  ")[0] for line in (run_dir / "train.log").read_text().splitlines()]
    assert [s.split(":")[0] for s in said if not s.startswith("step ")] == [
        f"start at step 0 of {2 * N}", "eval step 0", "checkpoint", "checkpoint", f"end at step {N + K}",
        f"start at step {N + K} of {2 * N}", f"eval step {2 * N}", "checkpoint", f"end at step {2 * N}"]
    assert [s.split(" (")[0] for s in said if s.startswith("checkpoint")] == [
        f"checkpoint: step_{N:08d} saved", f"checkpoint: step_{N + K:08d} saved", f"checkpoint: step_{2 * N:08d} saved"]
    assert f"checkpoint: step_{N + K:08d} saved (preempt, " in "\n".join(said)
    assert said[-1] == f"end at step {2 * N}: finished" and f"end at step {N + K}: stopped" in said
    assert [s.split()[1] for s in said if s.startswith("step ")] == [f"{i}/{2 * N}" for i in range(1, 2 * N + 1)]


def test_second_signal_aborts_at_once(base, tmp_path):
    run_dir = tmp_path / "run"
    aborted = train([*base, f"train.run_dir={run_dir}"], "term2", N + K)
    assert aborted.returncode == -signal.SIGTERM
    assert "aborting without a checkpoint" in aborted.stderr
    assert not (run_dir / "checkpoints" / f"step_{N + K:08d}").exists()


def test_crash_writes_an_emergency_checkpoint_then_fails(base, reference, tmp_path):
    run_dir = tmp_path / "run"
    crashed = train([*base, f"train.run_dir={run_dir}"], "crash", N + K)
    assert crashed.returncode == 1 and "RuntimeError: injected failure" in crashed.stderr
    assert f"emergency checkpoint of step {N + K}" in crashed.stdout
    meta = json.loads((run_dir / "checkpoints" / f"step_{N + K:08d}" / "meta.json").read_text())
    assert meta["reason"] == "emergency"
    again = resume(run_dir)
    assert again.returncode == 0, again.stderr
    assert losses(run_dir)[0] == reference


def test_streaming_data_resumes_bit_for_bit(base, tmp_path):
    streaming = [*base, "data.streaming=true"]
    ref_dir, run_dir = tmp_path / "a", tmp_path / "b"
    assert train([*streaming, f"train.run_dir={ref_dir}"]).returncode == 0
    assert train([*streaming, f"train.run_dir={run_dir}"], "kill", N + K).returncode == -signal.SIGKILL
    again = resume(run_dir)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout
    assert losses(run_dir)[0] == losses(ref_dir)[0]
