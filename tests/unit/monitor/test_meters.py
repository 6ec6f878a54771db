"""Throughput meters: tokens/s, MFU against a given or looked-up peak, and the data-wait fraction."""

import pytest
import torch

from kiln.monitor.meters import Throughput, peak_flops


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_tokens_per_second_mfu_and_data_wait():
    clock = FakeClock()
    meter = Throughput(flops_per_token=1e9, device=torch.device("cpu"), peak=1e12, clock=clock)
    clock.advance(7.0)  # before start: not counted
    meter.start(step=10)
    with meter.waiting_for_data():
        clock.advance(0.05)
    clock.advance(0.05)
    m = meter.read(step=12, tokens_per_step=1000)
    assert m["tokens_per_s"] == pytest.approx(2000 / 0.1)
    assert m["mfu"] == pytest.approx(2000 / 0.1 * 1e9 / 1e12)
    assert m["data_wait"] == pytest.approx(0.5)
    clock.advance(0.02)  # the next interval starts at the last read, with no waiting carried over
    m2 = meter.read(step=13, tokens_per_step=1000)
    assert m2["data_wait"] == 0.0 and m2["tokens_per_s"] == pytest.approx(1000 / 0.02)


def test_no_peak_on_cpu_means_no_mfu():
    assert peak_flops(torch.device("cpu")) is None
    meter = Throughput(flops_per_token=1e9, device=torch.device("cpu"))
    meter.start(0)
    assert "mfu" not in meter.read(1, 100)


def test_paused_time_is_left_out():
    clock = FakeClock()
    meter = Throughput(flops_per_token=0.0, device=torch.device("cpu"), clock=clock)
    meter.start(0)
    clock.advance(0.05)
    with meter.paused():
        clock.advance(0.3)
    m = meter.read(1, 1000)
    assert m["tokens_per_s"] == pytest.approx(1000 / 0.05)  # 0.05 s of training, not 0.35
    assert "mfu" not in m
    clock.advance(0.1)  # the pause is not carried into the next interval
    assert meter.read(2, 1000)["tokens_per_s"] == pytest.approx(1000 / 0.1)


def test_peak_table_picks_the_most_specific_name():
    from kiln.monitor.meters import peak_for_name

    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA L40S") == 362e12 and peak_for_name("NVIDIA L4") == 121e12
    assert peak_for_name("NVIDIA A10G") == 70e12 and peak_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_for_name("Some Future GPU") is None


def test_each_read_on_a_gpu_counts_the_allocators_retries_since_the_last(monkeypatch):
    """The CUDA allocator's retries are counted per interval (its counter only grows); the CUDA calls are stood in
    for here, on the CPU."""
    stats = {"num_alloc_retries": 3}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    meter = Throughput(flops_per_token=0.0, device=torch.device("cuda"), peak=1.0, clock=iter(range(100)).__next__)
    meter.start(0)  # the retries before the training steps (start-up, compile) are not theirs
    stats["num_alloc_retries"] = 5
    assert meter.read(1, 8)["alloc_retries"] == 2
    assert meter.read(2, 8)["alloc_retries"] == 0
    stats["num_alloc_retries"] = 6
    assert meter.read(3, 8)["alloc_retries"] == 1
