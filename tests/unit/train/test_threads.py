"""train.threads / kiln generate --threads: applied on the CPU, left alone on a GPU, 1 for small models."""

import pytest
import torch

from kiln.train.threads import SMALL_MODEL, apply_threads, cpu_threads

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


def test_the_default_is_one_thread_for_a_small_model_and_pytorchs_otherwise():
    torch.set_num_threads(2)
    assert apply_threads(None, CPU, 4_000_000) == 1
    torch.set_num_threads(2)
    assert apply_threads(None, CPU, 2 * SMALL_MODEL) == 2  # left as PyTorch chose
    assert cpu_threads(None, SMALL_MODEL - 1) == 1 and cpu_threads(None, SMALL_MODEL) is None


def test_omp_num_threads_wins_over_the_default_not_over_a_setting(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(None, 1000) is None
    assert cpu_threads(4, 1000) == 4


def test_a_gpu_run_keeps_pytorchs_threads():
    torch.set_num_threads(2)
    assert apply_threads(1, GPU, 1000) == 2 == torch.get_num_threads()
