"""Two real processes (gloo): one checkpoint from both ranks (plain or FSDP2-sharded), exact continuation
in 2 processes and in 1, the first log after a resume as an uninterrupted run's, and a signal seen by one rank stops
both at the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.state.checkpointer import Checkpointer

from .conftest import make_trainer, run_steps

HERE = Path(__file__).parent

WORKER = r'''
import json, os, signal, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from conftest import make_trainer, run_steps
from kiln.state.checkpointer import Checkpointer
from kiln.state.preempt import SignalGuard

run_dir, out = sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
t = make_trainer(run_dir, async_save=True)
run_steps(t, 2)
ck = Checkpointer(run_dir, t.cfg, {"dataset": "d"}, print)
path = ck.save(t)
ck.wait()
expected = run_steps(t, 3)
from kiln.state.resume import resume_target
assert resume_target(t.cfg, "auto", print)[1] == path  # rank 0 chooses, the other rank takes its choice
fresh = make_trainer(run_dir)
Checkpointer(run_dir, fresh.cfg, {"dataset": "d"}, print).load(fresh, path)
assert run_steps(fresh, 3) == expected, "2-process resume differs"
with SignalGuard(group=ck.control_group) as guard:
    ck.save(t)  # in flight in the background while the main thread runs its own collectives
    for _ in range(20):
        assert guard.should_stop() is None
    ck.wait()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    between = [guard.should_stop(step) for step in range(11, 20)]  # no collective between checks
    stop = guard.should_stop(20)
    assert guard.should_stop() == "SIGTERM"  # asked outside the step cadence: checked at once
assert between == [None] * 9, (rank, between)
assert stop == "SIGTERM", (rank, stop)
if rank == 0:
    json.dump({"path": str(path), "expected": expected}, open(out, "w"))
ck.close()
'''


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """WORKER then FSDP_WORKER in 2 gloo processes under one torchrun; for each, its run directory and the
    JSON that rank 0 wrote."""
    root = tmp_path_factory.mktemp("two")
    worker = root / "worker.py"
    worker.write_text(WORKER + LOGGED_WORKER + FSDP_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
           str(HERE), str(root / "run"), str(root / "out.json"), str(root / "fsdp_run"), str(root / "fsdp_out.json"),
           str(root / "logged_run"), str(root / "logged_out.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: (root / f"{prefix}run", json.loads((root / f"{prefix}out.json").read_text()))
            for name, prefix in (("plain", ""), ("fsdp", "fsdp_"), ("logged", "logged_"))}


@pytest.mark.slow  # torchrun, two processes
def test_two_ranks_save_once_and_resume_in_two_or_one(two_processes):
    run_dir, result = two_processes["plain"]
    path = Path(result["path"])
    assert {"rank0.json", "rank1.json"} <= {p.name for p in path.iterdir()}
    assert json.loads((path / "meta.json").read_text())["world_size"] == 2

    one = make_trainer(run_dir)  # a single process continues the 2-process run exactly
    Checkpointer(run_dir, one.cfg, {"dataset": "d"}, print).load(one, path)
    assert one.step == 2 and run_steps(one, 3) == result["expected"]


@pytest.mark.slow  # torchrun, two processes
def test_the_first_log_after_a_resume_is_the_uninterrupted_runs_mean_over_both_ranks(two_processes):
    _, result = two_processes["logged"]
    assert result["resumed"] == pytest.approx(result["uninterrupted"], rel=1e-6)
    assert list(result["resumed"]) == ["4"]


# run after WORKER in the same processes (one torchrun start for all three), in a run directory of its own: a run
# logging every 4 steps, each rank on rows of its own (DDP), checkpointed at step 2 (losses of 2 steps not yet
# logged) and resumed from there; the losses its step 4 logs, uninterrupted and resumed
LOGGED_WORKER = r'''
import torch
from conftest import PositionalBatches
from kiln.config import RunConfig
from kiln.events import Callback
from kiln.model.llama import Transformer
from kiln.train.trainer import Trainer

class Logged(Callback):
    def __init__(self, ck=None):
        self.ck, self.losses = ck, {}

    def on_step_end(self, trainer, metrics):
        if metrics:
            self.losses[trainer.step] = metrics["loss"]
        if self.ck is not None and trainer.step == 2:
            self.ck.save(trainer)

def logged_trainer():
    cfg = RunConfig.model_validate({"model": {"size": "tiny", "vocab_size": 256}, "logging": {"every": 4},
        "train": {"seq_len": 16, "batch_size": 2, "max_steps": 4, "warmup_steps": 1, "device": "cpu",
                  "run_dir": sys.argv[6]}})
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Transformer(cfg.model))
    return Trainer(cfg, model, PositionalBatches(1 + rank), None, torch.device("cpu"))

whole = logged_trainer()
ck = Checkpointer(sys.argv[6], whole.cfg, {"dataset": "d"}, print)
whole.events.callbacks.append(uninterrupted := Logged(ck))
whole.train()
ck.wait()
resumed = logged_trainer()
ck.load(resumed, ck.dir / "step_00000002")
resumed.events.callbacks.append(after := Logged())
resumed.train()
if rank == 0:
    json.dump({"uninterrupted": uninterrupted.losses, "resumed": after.losses}, open(sys.argv[7], "w"))
ck.close()
'''

FSDP_WORKER = r'''
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from kiln.train.optim import build_optimizer, build_scheduler

run_dir, out = sys.argv[4], sys.argv[5]
mesh = init_device_mesh("cpu", (2,))
t = make_trainer(run_dir, async_save=True)
for layer in t.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(t.model, mesh=mesh)  # parameters become DTensors, sharded over the 2 processes
t.optimizer = build_optimizer(t.model, t.cfg.optim, t.cfg.train.lr, torch.device("cpu"))
t.scheduler = build_scheduler(t.optimizer, t.cfg.train)
run_steps(t, 2)
ck = Checkpointer(run_dir, t.cfg, {"dataset": "d"}, print)
path = ck.save(t)
ck.wait()
expected = run_steps(t, 3)
if dist.get_rank() == 0:
    json.dump({"path": str(path), "expected": expected}, open(out, "w"))
ck.close()
dist.destroy_process_group()
'''


@pytest.mark.slow  # torchrun, two processes
def test_fsdp2_sharded_checkpoint_reshards_to_one_process(two_processes):
    run_dir, result = two_processes["fsdp"]
    one = make_trainer(run_dir)  # plain tensors in one process, loaded from DTensor shards of two
    Checkpointer(run_dir, one.cfg, {"dataset": "d"}, print).load(one, Path(result["path"]))
    assert run_steps(one, 3) == result["expected"]


TIMEOUT_WORKER = r'''
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from kiln.config import RunConfig
from kiln.state.checkpointer import Checkpointer

dist.init_process_group("gloo", timeout=timedelta(seconds=600))
cfg = RunConfig.model_validate({"train": {"device": "cpu", "run_dir": sys.argv[1]}, "dist": {"timeout_s": 3}})
ck = Checkpointer(sys.argv[1], cfg, {}, print)
if dist.get_rank() == 0:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.zeros(1), group=ck.control_group)  # rank 1 never joins it
    except Exception:
        print(f"gave up after {time.monotonic() - t0:.0f} s", flush=True)
    open(sys.argv[1] + "/gave_up", "w").close()
else:  # away from the collective until rank 0 has given up on it (40 s at most)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 40 and not os.path.exists(sys.argv[1] + "/gave_up"):
        time.sleep(0.2)
'''


@pytest.mark.slow  # torchrun, two processes
def test_the_checkpoint_groups_wait_dist_timeout_s_not_torchs_30_minutes(tmp_path):
    """A stopped rank left the others in a checkpoint collective for torch's default 30 minutes."""
    worker = tmp_path / "worker.py"
    worker.write_text(TIMEOUT_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
           str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    waited = [line for line in done.stdout.splitlines() if line.startswith("gave up after")]
    assert waited, done.stdout[-2000:] + done.stderr[-2000:]
    assert int(waited[0].split()[3]) < 30  # dist.timeout_s=3, with room for a loaded machine
