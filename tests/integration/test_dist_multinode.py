"""Two nodes simulated on one machine: two torchrun agents (`--nnodes 2 --nproc_per_node 1`, c10d rendezvous on
127.0.0.1), one process each, sharing one run directory as nodes share storage, against one process with the
same global batch:

- FSDP hybrid (each node a replica, as dist.replicas defaults to) trains with the one process's losses; SIGTERM
  to one node's torchrun alone (a scheduler preempting that node) stops both nodes promptly at one complete
  checkpoint, the other node's torchrun included (it waited 300 s in torchrun's exit barrier); both started
  again resume it with the same losses. Only global rank 0 writes the console and the run files.
- FSDP full trains with the one process's losses too, and DDP through the sbatch script of `kiln launch slurm
  --nodes 2`, run by bash with stand-ins for scontrol and srun (one task per node, SLURM_NODEID and
  SLURMD_NODENAME as Slurm sets them).

No fixed sleeps: the tests poll the run directory until what they wait for is there."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.parallel.launch.torchrun import TORCHRUN_ENV
from kiln.state.rundir import checkpoints

from .conftest import kiln_here, losses, stdlib_corpus, tiny_cpu_run

STEPS, EVERY = 40, 5
ENV = {**os.environ, **TORCHRUN_ENV, "COLUMNS": "400", "OMP_NUM_THREADS": "1"}
RUN_FILES = {".lock", ".lock-holder.json", "config.yaml", "started_in.json", "checkpoints", "metrics.jsonl",
             "train.log", "model"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    cache, corpus = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("corpus")
    stdlib_corpus(corpus, 240)
    return [*tiny_cpu_run(cache, corpus, STEPS, EVERY), "checkpoint.keep_last=100"]


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict[int, float]:
    """The losses of one process with the global batch of the two nodes (2 sequences each), trained in this one
    (kiln_here: a new interpreter adds seconds of imports; the nodes' losses are compared within a tolerance)."""
    run_dir = tmp_path_factory.mktemp("runs") / "one"
    done = kiln_here("train", *base, "train.batch_size=4", f"train.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


class Nodes:
    """Two torchrun agents of one job, each a node of one process; their output in files under `logs`."""

    def __init__(self, logs: Path, *train_args: str):
        logs.mkdir()
        self.logs, port = logs, free_port()
        rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                f"127.0.0.1:{port}", "--rdzv_id", f"job{port}"]
        command = [sys.executable, "-m", "kiln.parallel.launch.torchrun", *rdzv, "-m", "kiln.cli", "train", *train_args]
        self.agents = [subprocess.Popen(command, stdout=open(logs / f"node{n}.out", "w"),
                                        stderr=open(logs / f"node{n}.err", "w"), env=ENV) for n in range(2)]

    def out(self, n: int) -> str:
        return (self.logs / f"node{n}.out").read_text()

    def text(self) -> str:
        return "".join(f"--- node{n}\n{self.out(n)}{(self.logs / f'node{n}.err').read_text()[-3000:]}"
                       for n in range(2))

    def first(self) -> int:
        """The node whose process is global rank 0 (c10d's rendezvous orders the nodes as they come): the one
        that prints."""
        return 0 if "run directory:" in self.out(0) else 1

    def wait_until(self, what, timeout: float = 240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            assert all(a.poll() is None for a in self.agents), f"a node ended first:\n{self.text()}"
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting:\n{self.text()}")

    def wait(self, timeout: float) -> list[int]:
        """Both agents' exit codes; fails if either is still running `timeout` s from now (killing both)."""
        deadline = time.monotonic() + timeout
        try:
            return [a.wait(timeout=max(0.1, deadline - time.monotonic())) for a in self.agents]
        except subprocess.TimeoutExpired:
            for a in self.agents:
                a.kill()
                a.wait()
            raise AssertionError(f"a node still ran {timeout} s on:\n{self.text()}") from None


@pytest.mark.slow
def test_hybrid_over_two_nodes_trains_stops_on_one_nodes_sigterm_and_resumes_like_one_process(base, reference,
                                                                                                 tmp_path):
    run_dir = tmp_path / "run"
    args = [*base, "train.batch_size=2", "dist.strategy=fsdp", "dist.sharding=hybrid", f"train.run_dir={run_dir}"]
    job = Nodes(tmp_path / "first", *args)
    job.wait_until(lambda: checkpoints(run_dir) and "global batch" in job.out(0) + job.out(1))
    first = job.first()
    other = 1 - first
    job.agents[other].send_signal(signal.SIGTERM)  # the node without rank 0: the console is rank 0's
    codes = job.wait(timeout=60)  # before: the node not signalled waited 300 s in torchrun's exit barrier
    assert codes[other] == 128 + signal.SIGTERM and codes[first] == 0, job.text()
    out = job.out(first)
    assert "2 data-parallel rank(s); fsdp hybrid, 2 replica(s) x 1 shards" in out  # a replica per node
    assert "stopped by SIGTERM after step" in out, job.text()
    stopped = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert stopped < STEPS and f"checkpoint {run_dir / 'checkpoints' / f'step_{stopped:08d}'} is complete" in out
    assert "under torchrun on every node, as this job was started" in out
    assert job.out(other) == ""  # only global rank 0 writes the console
    err = (job.logs / f"node{first}.err").read_text()  # where the signalled node served the store: gone now
    assert "frame #" not in err and "failed to shutdown the rendezvous" not in err, err[-3000:]
    assert "kiln: the job stopped on SIGTERM" in (job.logs / f"node{other}.err").read_text()
    assert max(int(c.name.split("_")[1]) for c in checkpoints(run_dir)) == stopped
    assert {p.name for p in run_dir.iterdir()} <= RUN_FILES - {"model"}

    again = Nodes(tmp_path / "again", *args)
    assert again.wait(timeout=240) == [0, 0], again.text()
    resumed = again.out(again.first())
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped:08d}'}" in resumed
    assert again.out(1 - again.first()) == ""
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in got] == pytest.approx([reference[s] for s in got], rel=1e-4)
    assert {p.name for p in run_dir.iterdir()} <= RUN_FILES and (run_dir / "model").is_dir()


@pytest.mark.slow
def test_the_slurm_script_of_two_nodes_trains_ddp_like_one_process(base, reference, tmp_path):
    from typer.testing import CliRunner

    from kiln.cli import app

    run_dir, script, config = tmp_path / "run", tmp_path / "train.sbatch", tmp_path / "tiny.yaml"
    config.write_text("model:\n  size: tiny\n")  # a config file, as users pass one
    res = CliRunner().invoke(app, ["launch", "slurm", str(config), *base, "train.batch_size=2", "dist.strategy=ddp",
                                   "--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(run_dir), "--out",
                                   str(script)])
    assert res.exit_code == 0, res.output
    text = script.read_text()
    assert ":29500" in text
    script.write_text(text.replace(":29500", f":{free_port()}"))  # the machine's other jobs may hold 29500
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\necho 127.0.0.2\n")  # the job's two hosts
    # srun: one task per node, as Slurm starts them, each with its node's identity
    (bin_dir / "srun").write_text(f"#!/bin/bash\nshift\nfor n in 0 1; do\n"
                                  f"  SLURM_NODEID=$n SLURMD_NODENAME=node$n SLURM_PROCID=$n \"$@\" "
                                  f"> {logs}/node$n.out 2> {logs}/node$n.err &\n  pids+=($!)\ndone\n"
                                  "code=0\nfor p in \"${pids[@]}\"; do wait $p || code=$?; done\nexit $code\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in ENV.items() if k not in TORCHRUN_ENV}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_NODELIST="nodes", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_ID="42")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)
    outs = [(logs / f"node{n}.out").read_text() for n in range(2)]
    assert done.returncode == 0, done.stderr + "".join(outs) + (logs / "node0.err").read_text()[-3000:]
    assert sum("global batch: 4 sequences" in o for o in outs) == 1 and "" in outs  # one node prints: rank 0's
    assert "2 data-parallel rank(s); ddp" in "".join(outs)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in got] == pytest.approx([reference[s] for s in got], rel=1e-4)


@pytest.mark.slow
def test_fsdp_full_over_two_nodes_trains_like_one_process(base, reference, tmp_path):
    run_dir = tmp_path / "run"
    job = Nodes(tmp_path / "logs", *base, "train.batch_size=2", "dist.strategy=fsdp", f"train.run_dir={run_dir}")
    assert job.wait(timeout=240) == [0, 0], job.text()
    assert "2 data-parallel rank(s); fsdp full (ZeRO-3)" in job.out(job.first()) and job.out(1 - job.first()) == ""
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in got] == pytest.approx([reference[s] for s in got], rel=1e-4)
