"""The resource monitor: real readings of this process tree and its disk, readings in every logging step's
metrics, and each warning once, as an event the sinks record."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from kiln.config import MonitorConfig
from kiln.events import Callback, Events
from kiln.monitor.nvml import NvmlReader
from kiln.monitor.resources import ResourceMonitor, Sampler
from kiln.monitor.sinks import JsonlSink


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_sampler_reads_the_process_tree_and_the_disks(tmp_path):
    clock = FakeClock()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        sampler = Sampler(tmp_path / "run", tmp_path, clock=clock)  # the run directory need not exist yet
        first = sampler.sample()
        assert child.pid in sampler._procs  # children are part of the tree
        assert first["rss_gib"] > 0 and first["disk_free_gb_run"] > 0 and first["disk_free_gb_cache"] > 0
        assert "disk_write_mb_s" not in first  # a rate needs two samples
        (tmp_path / "blob").write_bytes(b"x" * 1_000_000)
        clock.t += 2.0
        second = sampler.sample()
        assert second["disk_write_mb_s"] >= 0 and second["disk_read_mb_s"] >= 0
        assert second["cpu_percent"] >= 0
    finally:
        child.stdin.close()
        child.wait(timeout=30)


class FakeNvml:
    """pynvml's calls, answering like a hot, power-capped GPU."""

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlDeviceGetHandleByIndex(self, i): return f"gpu{i}"
    def nvmlDeviceGetHandleByUUID(self, uuid): raise RuntimeError("no such uuid")
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(used=76 << 30, total=80 << 30)
    def nvmlDeviceGetUtilizationRates(self, h): return SimpleNamespace(gpu=97)
    def nvmlDeviceGetPowerUsage(self, h): return 699_000
    def nvmlDeviceGetTemperature(self, h, kind): return 88
    def nvmlDeviceGetClockInfo(self, h, kind): return 1755
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return 0x04 | 0x40


def test_nvml_readings_and_throttle_reasons():
    out = NvmlReader(0, "abc", nvml=FakeNvml()).read()
    assert out["gpu_util"] == 97 and out["gpu_power_w"] == 699 and out["gpu_temp_c"] == 88
    assert out["gpu_mem_frac"] == 0.95 and out["gpu_sm_clock_mhz"] == 1755
    assert out["gpu_throttle_thermal"] == 1 and out["gpu_throttle_power"] == 1


class Recorder(Callback):
    def __init__(self):
        self.events, self.metrics = [], []

    def on_notice(self, trainer, kind, data):
        self.events.append((kind, data))

    def on_step_end(self, trainer, metrics):
        if metrics:
            self.metrics.append(dict(metrics))


class Values:
    def __init__(self, **values):
        self.values = values
        self.calls = 0

    def sample(self):
        self.calls += 1
        return dict(self.values)


def _run(monitor, sinks, steps: list[dict | None]):
    trainer = SimpleNamespace(step=0, events=Events([monitor, *sinks]))
    trainer.events.emit("on_train_start", trainer)
    for metrics in steps:
        trainer.step += 1
        trainer.events.emit("on_step_end", trainer, metrics)
    trainer.events.emit("on_train_end", trainer, {})
    return trainer


def test_readings_reach_the_sinks_and_each_condition_warns_once(tmp_path):
    sampler = Values(gpu_mem_frac=0.97, gpu_throttle_thermal=1.0, gpu_temp_c=91.0, gpu_throttle_power=0.0,
                     disk_free_gb_run=500.0)
    said: list[str] = []
    monitor = ResourceMonitor(MonitorConfig(), sampler, checkpoint_bytes=10**9, log=said.append, thread=False)
    rec, jsonl = Recorder(), JsonlSink(tmp_path / "metrics.jsonl")
    # logging every 4 steps: the first record and those within the first 10 steps are warm-up; then 5 make a window
    steps = [{"loss": 1.0, "data_wait": 0.3} if s % 4 == 0 else None for s in range(1, 41)]
    _run(monitor, [rec, jsonl], steps)
    assert rec.metrics[0]["sys/gpu_mem_frac"] == 0.97 and rec.metrics[1]["sys/disk_free_gb_run"] == 500.0
    assert all(m["sys/peak_rss_gib"] > 0.01 for m in rec.metrics)
    conditions = [d["condition"] for kind, d in rec.events if kind == "warning"]
    assert sorted(conditions) == ["data_wait", "gpu_memory", "thermal"]  # once each, though seen twice
    assert len(said) == 3 and any("heat" in s for s in said)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["condition"] for r in rows if r["event"] == "warning") == sorted(conditions)
    assert all("message" in r and "step" in r for r in rows if r["event"] == "warning")



def test_a_data_wait_just_over_the_limit_does_not_read_as_equal_to_it():
    said: list[str] = []
    monitor = ResourceMonitor(MonitorConfig(), Values(), checkpoint_bytes=0, log=said.append, thread=False)
    monitor.check({}, 0.104)  # the default limit is 10%
    assert len(said) == 1 and "waited for data 10.4% of the time" in said[0]
    small = ResourceMonitor(MonitorConfig(data_wait_warn=0.005), Values(), 0, log=said.append, thread=False)
    small.check({}, 0.0123)
    assert "waited for data 1.23% of the time" in said[1] and "monitor.data_wait_warn=0.5%)" in said[1]


def test_the_data_wait_of_the_warm_up_is_left_out_and_a_later_slowdown_warns_again_after_a_recovery(tmp_path):
    """Streaming waits for its first files (33% at the first record, under 1% after): no warning. A slowdown
    later warns; once the window is back under half the limit that is said, and the next slowdown warns again."""
    said: list[str] = []
    monitor = ResourceMonitor(MonitorConfig(), Values(), checkpoint_bytes=0, log=said.append, thread=False)
    waits = [0.33, 0.005, 0.005, 0.005, 0.005, 0.005, 0.005]  # steps 5..35, logging every 5
    waits += [0.4] * 5 + [0.01] * 5 + [0.3] * 5  # a slowdown, a recovery, another slowdown
    rec = Recorder()
    _run(monitor, [rec], [{"loss": 1.0, "data_wait": waits[s // 5 - 1]} if s % 5 == 0 else None
                          for s in range(1, 5 * len(waits) + 1)])
    warned = [(d["step"], d["condition"]) for kind, d in rec.events if kind == "warning"]
    assert warned == [(45, "data_wait"), (95, "data_wait")]  # over the limit in the window of the last 5 intervals
    assert any("waits for data" in s and "again" in s for s in said)


def test_host_memory_warns_near_its_end_and_again_after_a_recovery():
    said: list[str] = []
    monitor = ResourceMonitor(MonitorConfig(), Values(), checkpoint_bytes=0, log=said.append, thread=False)
    for used in (80.0, 96.0, 97.0, 93.0, 89.0, 96.5):
        monitor.check({"host_mem_percent": used}, None)
    warnings = [s for s in said if "host memory is" in s and "over monitor.host_memory_warn" in s]
    assert [w.split(" used")[0] for w in warnings] == ["warning: host memory is 96%", "warning: host memory is 96%"]
    assert any("host memory is 89% used again" in s for s in said)  # 93% is not yet a recovery (5 points under)

def test_disk_rule_before_each_save_uses_the_checkpoint_size():
    said: list[str] = []
    monitor = ResourceMonitor(MonitorConfig(), Values(), checkpoint_bytes=10**9, log=said.append, thread=False)
    monitor.before_save(step=10, free=5 * 10**9, needed=2 * 10**9)  # room for two more
    assert said == []
    monitor.before_save(step=20, free=3 * 10**9, needed=2 * 10**9)  # this one fits, the next may not
    assert len(said) == 1 and "before the checkpoint of step 20" in said[0] and "2 checkpoints" in said[0]
    assert monitor.checkpoint_bytes == 2 * 10**9  # the sampled free space is judged against it from now on
    off = ResourceMonitor(MonitorConfig(disk_checkpoints_warn=0), Values(), 10**9, log=said.append, thread=False)
    off.before_save(step=30, free=1, needed=2 * 10**9)
    assert len(said) == 1


def test_sampling_happens_in_the_thread_at_logging_steps():
    sampled = threading.Event()

    class Signalling(Values):
        def sample(self):
            out = super().sample()
            sampled.set()
            return out

    sampler = Signalling(cpu_percent=12.0)
    monitor = ResourceMonitor(MonitorConfig(), sampler, 10**9, log=lambda s: None)
    trainer = SimpleNamespace(step=0, events=Events([monitor]))
    monitor.on_train_start(trainer)
    assert sampled.wait(30)
    assert monitor._thread.name == "kiln-resources" and monitor._thread is not threading.current_thread()
    monitor.close()  # joins the thread: its sample is stored
    metrics = {"loss": 1.0}
    monitor.on_step_end(trainer, metrics)
    monitor.on_step_end(trainer, None)  # not a logging step: no sample asked for
    assert metrics["sys/cpu_percent"] == 12.0 and sampler.calls == 1


@pytest.mark.slow
def test_a_run_warns_before_a_save_that_leaves_no_room_for_the_next(tmp_path, monkeypatch):
    import kiln.state.checkpointer as checkpointer_mod
    from kiln.config import load_config
    from kiln.train.run import run

    real = checkpointer_mod.check_room

    def tight(*args, **kwargs):  # the real check, on a disk with room for 1.5 checkpoints
        free, needed = real(*args, **kwargs)
        return int(needed * 1.5), needed

    monkeypatch.setattr(checkpointer_mod, "check_room", tight)
    cfg = load_config(None, ["model.size=tiny", "data.max_bytes=150000", "data.vocab_size=300", "train.seq_len=32",
                             "train.batch_size=2", "train.max_steps=4", "train.eval_every=0", "train.sample_tokens=0",
                             "checkpoint.every=2", "checkpoint.save_final=false", "logging.every=1",
                             f"train.run_dir={tmp_path / 'r'}", "train.device=cpu",
                             "monitor.data_wait_warn=1"])  # a loaded test machine may wait for data
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    warnings = [r for r in rows if r["event"] == "warning"]
    assert [w["condition"] for w in warnings] == ["disk"]  # once, though every save was tight
    assert "before the checkpoint of step 2" in warnings[0]["message"]
    assert all("sys/rss_gib" in r for r in rows if r["event"] == "train")


def test_the_peak_resident_memory_is_each_intervals_own_and_the_process_lifetime_peak_stays():
    """A record reports the peak of its interval (an allocation made and freed in it), the next one the lower level
    after it; the process's lifetime peak, which /usr/bin/time and schedulers report, is left as it is."""
    import resource
    import sys

    from kiln.monitor.resources import PeakRss

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    peak = PeakRss()
    peak.read()
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    block = bytearray(lifetime * 1024 + (256 << 20))  # beyond any earlier high of this process
    block[::4096] = b"x" * len(block[::4096])  # touch every page: resident
    del block
    high = peak.read()
    assert high * 2**20 > lifetime + (200 << 10)  # the freed block's high, in this interval
    after = peak.read()  # no new high since: the polled and present sizes
    assert after < high - 0.15
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= high * 2**30 * 0.99  # not reset
