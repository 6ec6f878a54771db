"""train.threads / kiln generate --threads: applied on the CPU, left alone on a GPU; by default a small model
trains on the cores other processes leave idle and samples with 1 thread."""

import pytest
import torch

from kiln.plan import threads
from kiln.plan.threads import SMALL_MODEL, apply_threads, cpu_threads, idle_of

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_setting_is_applied_on_the_cpu():
    assert apply_threads(3, CPU, 1000) == 3 == torch.get_num_threads()
    assert apply_threads(1, CPU, 10 * SMALL_MODEL) == 1 == torch.get_num_threads()


def test_the_default_trains_a_small_model_on_the_idle_cores_samples_with_one_and_leaves_a_big_one(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "idle_cores", lambda: 2)  # an idle 2-core machine
    assert apply_threads(None, CPU, 4_000_000) == 2
    assert apply_threads(None, CPU, 4_000_000, sampling=True) == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "idle_cores", lambda: 1)  # one core taken by another process
    assert apply_threads(None, CPU, 4_000_000) == 1
    torch.set_num_threads(2)
    assert apply_threads(None, CPU, 2 * SMALL_MODEL) == 2  # left as PyTorch chose
    assert cpu_threads(None, SMALL_MODEL) is None


def readings(busy: float, own: float, cpus: int = 4, wall: float = 1.0):
    """Two psutil.cpu_times readings `wall` s apart on `cpus` CPUs, `busy` cores' worth busy between them."""
    before = {"user": 0.0, "nice": 0.0, "system": 0.0, "idle": 0.0, "iowait": 0.0, "guest": 0.0}
    after = {"user": busy * wall * 0.8, "nice": 0.0, "system": busy * wall * 0.2, "idle": (cpus - busy) * wall,
             "iowait": 0.0, "guest": busy * wall * 0.5}  # guest time is part of user time
    return before, after, own * wall


def test_idle_cores_leave_out_this_processes_own_use():
    assert idle_of(*readings(busy=0.1, own=0.0), cpus=4, cores=4) == 4  # an idle machine
    assert idle_of(*readings(busy=3.0, own=0.0), cpus=4, cores=4) == 1  # three cores busy elsewhere
    assert idle_of(*readings(busy=3.0, own=2.0), cpus=4, cores=4) == 3  # two of them are this process
    assert idle_of(*readings(busy=0.0, own=0.0), cpus=4, cores=2) == 2  # an affinity of 2 cores
    assert idle_of(*readings(busy=4.0, own=0.0), cpus=4, cores=4) == 1  # never less than one


def test_cores_kept_busy_by_other_processes_are_not_counted_idle():
    import multiprocessing as mp

    n = threads.usable_cores()
    spinners = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for p in spinners:
        p.start()
    try:
        import time

        time.sleep(1.0)  # the spinners are running
        assert threads.idle_cores(0.5) == 1
    finally:
        for p in spinners:
            p.kill()
            p.join()


def _spin():
    while True:
        pass


def test_omp_num_threads_wins_over_the_default_not_over_a_setting(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(None, 1000) is None
    assert cpu_threads(4, 1000) == 4


def test_a_gpu_run_keeps_pytorchs_threads():
    torch.set_num_threads(2)
    assert apply_threads(1, GPU, 1000) == 2 == torch.get_num_threads()
