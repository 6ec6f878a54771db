"""Prometheus sink: an HTTP GET of its endpoint, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import re
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from kiln.events import Events
from kiln.monitor.sinks.prometheus import PrometheusSink, metric_name

pytest.importorskip("prometheus_client")


def scrape(port: int) -> dict[str, tuple[float, dict]]:
    return {s.name: (s.value, s.labels) for fam in families(port) for s in fam.samples}


def families(port: int) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return list(text_string_to_metric_families(body))


def test_the_endpoint_serves_the_latest_value_of_every_metric_in_base_units(tmp_path, config):
    cfg = config("logging.prometheus_port=0", "logging.prometheus_addr=127.0.0.1")
    sink = PrometheusSink(cfg, tmp_path / "my-run", log=print)
    trainer = SimpleNamespace(step=0, cfg=cfg, device=torch.device("cpu"))
    events = Events([sink], log=print)
    events.emit("on_eval_end", trainer, {"step": 0, "tokens": 0, "val_loss": 5.0, "val_ppl": 148.4})
    events.emit("on_train_start", trainer)
    before = time.time()
    for s in (1, 2):
        trainer.step = s
        events.emit("on_step_end", trainer, {"step": s, "loss": 4.0 / s, "lr": 1e-3, "tokens": 128 * s,
                                             "tokens_per_s": 500.0, "mfu": 0.25, "rss_gib": 0.5,
                                             "cpu_percent": 150.0, "disk_read_mb_s": 2.0,
                                             "disk_free_gb_run": 12.0, "gpu0.util%": 90.0 + s})
        events.emit("on_step_end", trainer, None)  # not a logging step: nothing changes
    got = scrape(sink.port)
    assert got["kiln_train_loss"] == (2.0, {"run": "my-run"})
    assert got["kiln_train_step"][0] == 2 and got["kiln_train_learning_rate"][0] == 1e-3
    assert got["kiln_eval_loss"][0] == 5.0 and got["kiln_eval_perplexity"][0] == 148.4 and got["kiln_eval_step"][0] == 0
    assert got["kiln_rss_bytes"][0] == 2 ** 29 and got["kiln_cpu_ratio"][0] == 1.5  # GiB and percent: base units
    assert got["kiln_disk_read_bytes_per_second"][0] == 2e6 and got["kiln_disk_free_run_bytes"][0] == 12e9
    assert got["kiln_train_tokens_per_second"][0] == 500 and got["kiln_train_mfu_ratio"][0] == 0.25
    assert got["kiln_gpu0_util_ratio"][0] == pytest.approx(0.92)  # the monitor's keys, whatever they are
    assert got["kiln_train_tokens_total"][0] == 256  # train tokens: a counter; the evaluation's copy is not one
    assert not any("tokens" in name and name.startswith("kiln_eval") for name in got)
    assert before <= got["kiln_last_update_timestamp_seconds"][0] <= time.time()  # a dead run shows
    for kind in ("warning", "rollback", "warning"):
        events.emit("on_notice", trainer, kind, {"message": kind})
    counted = {s.labels["kind"]: s.value for f in families(sink.port) if f.name == "kiln_events" for s in f.samples}
    assert counted == {"rollback": 1, "warning": 2}
    kinds = {f.name: f.type for f in families(sink.port)}
    assert kinds["kiln_train_tokens"] == "counter" and kinds["kiln_train_loss"] == "gauge"
    for name in got:  # the naming guide: no unit but base units, counters end in _total
        assert not re.search(r"(gib|gb|mb|percent|_s)(_|$)", name), name
    events.emit("on_run_end", trainer, "finished")
    with pytest.raises(OSError):  # closed with the run
        scrape(sink.port)


def test_the_tokens_counter_never_goes_back_and_counts_steps_trained_again():
    from kiln.monitor.sinks.prometheus import Latest

    latest = Latest("r")
    for seen in (1000, 1100, 1200, 1000, 1100, 1300):  # a resumed run at 1000 tokens; a rollback from 1200 to 1000
        latest.update({"tokens": seen}, "train")
    assert latest.tokens == 1000 + 200 + 300


def test_metric_names_follow_the_naming_guide():
    assert metric_name("tokens_per_s") == ("kiln_train_tokens_per_second", 1.0)
    assert metric_name("mem/cuda:0 GiB") == ("kiln_mem_cuda_0_bytes", 2.0 ** 30)
    assert metric_name("gpu_util") == ("kiln_gpu_utilization_ratio", 0.01)
    assert metric_name("gpu_sm_clock_mhz") == ("kiln_gpu_sm_clock_hertz", 1e6)
    assert metric_name("gpu_temp_c") == ("kiln_gpu_temp_celsius", 1.0)
    assert metric_name("val_bpb", "eval") == ("kiln_eval_bits_per_byte", 1.0)


def test_a_port_in_use_disables_the_sink_and_training_goes_on(tmp_path, config):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = config(f"logging.prometheus_port={busy.getsockname()[1]}", "logging.prometheus_addr=127.0.0.1")
        sink, logged = PrometheusSink(cfg, tmp_path, log=print), []
        events = Events([sink], log=logged.append)
        trainer = SimpleNamespace(step=0, cfg=cfg)
        events.emit("on_train_start", trainer)
        events.emit("on_step_end", trainer, {"step": 1, "loss": 1.0})
    assert sink.disabled and len(logged) == 1 and "prometheus sink failed in on_train_start" in logged[0]
    port = cfg.logging.prometheus_port  # the message says which port, why, and what to set instead
    assert f"127.0.0.1:{port} (Address already in use)" in logged[0] and "logging.prometheus_port" in logged[0]
