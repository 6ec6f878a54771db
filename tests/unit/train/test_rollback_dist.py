"""Rollback in two real processes (gloo, DDP): a logging step makes one all-reduce, shared by the rollback's
check and the metrics, which come out as those of a run without rollback; a spike on one rank's rows is rolled
back by both ranks alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# logging every 5 steps, snapshots every 8, 16 steps: the check points are 5, 8, 10, 15 and 16. Global batch 8:
# step 10 trains samples 72..79, rank 1 the last 4; sample 78 (rank 1's) spikes its loss
CASES = {
    "checked": {"rollback": True, "log_every": 5},
    "unchecked": {"rollback": False, "log_every": 5},
    "spike": {"rollback": True, "log_every": 1, "poison": [78], "scale": -200.0},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of CASES, run in 2 gloo processes under one torchrun."""
    out = tmp_path_factory.mktemp("rollback_dist") / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "rollback_workers.py"), str(out), json.dumps(CASES)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{out}{rank}").read_text()) for rank in range(2)]


@pytest.mark.slow  # torchrun, two processes
def test_a_logging_step_makes_one_all_reduce_with_rollback_on_and_the_metrics_do_not_change(ranks):
    for rank in ranks:
        checked, unchecked = rank["checked"], rank["unchecked"]
        assert checked["wrapper"] == "DistributedDataParallel"
        # kiln's all-reduces by step: one at each check point, shared by the check and the metrics at a logging
        # step; without rollback, one at each logging step
        assert checked["reduces"] == {str(s): int(s in (5, 8, 10, 15, 16)) for s in range(1, 17)}
        assert unchecked["reduces"] == {str(s): int(s in (5, 10, 15, 16)) for s in range(1, 17)}
        assert checked["metrics"] == unchecked["metrics"]  # exactly
        assert list(checked["metrics"]) == ["5", "10", "15", "16"] and not checked["rollbacks"]
        assert checked["weights"] == unchecked["weights"]
    assert ranks[0]["checked"]["metrics"] == ranks[1]["checked"]["metrics"]  # the means over ranks


@pytest.mark.slow
def test_a_spike_on_one_ranks_rows_is_rolled_back_by_both_ranks(ranks):
    spikes = [rank["spike"] for rank in ranks]
    for spike in spikes:
        [info] = spike["rollbacks"]
        assert (info["bad_step"], info["to_step"], info["skipped"]) == (10, 8, [72, 80])
        assert "spike" in info["reason"] and spike["step"] == 16
        assert list(spike["metrics"]) == [str(s) for s in range(1, 17)]
    assert spikes[0]["rollbacks"] == spikes[1]["rollbacks"]  # the same verdict, from the same read
    assert spikes[0]["metrics"] == spikes[1]["metrics"] and spikes[0]["weights"] == spikes[1]["weights"]
