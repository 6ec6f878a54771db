"""Prometheus sink: an HTTP GET of its endpoint, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
import torch

from kiln.events import Events
from kiln.monitor.sinks.prometheus import PrometheusSink, metric_name

pytest.importorskip("prometheus_client")


def scrape(port: int) -> dict[str, tuple[float, dict]]:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: (s.value, s.labels) for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_the_endpoint_serves_the_latest_value_of_every_metric(tmp_path, config):
    cfg = config("logging.prometheus_port=0", "logging.prometheus_addr=127.0.0.1")
    sink = PrometheusSink(cfg, tmp_path / "my-run", log=print)
    trainer = SimpleNamespace(step=0, cfg=cfg, device=torch.device("cpu"))
    events = Events([sink], log=print)
    events.emit("on_eval_end", trainer, {"step": 0, "val_loss": 5.0})
    events.emit("on_train_start", trainer)
    for s in (1, 2):
        trainer.step = s
        events.emit("on_step_end", trainer, {"step": s, "loss": 4.0 / s, "gpu0.util%": 90.0 + s})
        events.emit("on_step_end", trainer, None)  # not a logging step: nothing changes
    got = scrape(sink.port)
    assert got["kiln_loss"] == (2.0, {"run": "my-run"})
    assert got["kiln_step"][0] == 2 and got["kiln_val_loss"][0] == 5.0
    assert got["kiln_gpu0_util_"][0] == 92.0  # the resource monitor's keys, whatever they are, sanitised
    events.emit("on_run_end", trainer, "finished")
    with pytest.raises(OSError):  # closed with the run
        scrape(sink.port)


def test_metric_names_are_valid_for_prometheus():
    assert metric_name("tokens_per_s") == "kiln_tokens_per_s"
    assert metric_name("mem/cuda:0 GiB") == "kiln_mem_cuda_0_GiB"


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
