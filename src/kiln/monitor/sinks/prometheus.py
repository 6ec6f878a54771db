"""Prometheus: an HTTP endpoint on rank 0 with the latest value of every metric, for a cluster's scraper.

`GET http://HOST:PORT/metrics` answers gauges named kiln_<metric> (the train metrics of the latest
logging step, the resource monitor's values that come with them, and the latest evaluation's), each
labelled with the run directory's name, plus kiln_step. Samples are not numbers and are left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from kiln.errors import ResourceError
from kiln.monitor.sinks.base import MetricSink, require


def metric_name(key: str) -> str:
    """A valid Prometheus metric name for a Kiln metric: kiln_ and the key with other characters as '_'."""
    return "kiln_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class Latest:
    """A prometheus_client collector of the latest values it was given: any names, all gauges."""

    def __init__(self, run: str):
        self.run = run
        self.values: dict[str, tuple[float, str]] = {}  # metric name -> (value, help)

    def update(self, values: dict[str, float], kind: str) -> None:
        for k, v in values.items():
            self.values[metric_name(k)] = (v, f"Kiln {kind} metric '{k}', latest value")

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        for name, (value, doc) in sorted(self.values.items()):
            gauge = GaugeMetricFamily(name, doc, labels=["run"])
            gauge.add_metric([self.run], value)
            yield gauge


class PrometheusSink(MetricSink):
    """Serves the latest metrics with prometheus_client (extra: prometheus) on logging.prometheus_port
    (0: a free port, logged) of logging.prometheus_addr, from the run's first event to its end."""

    name = "prometheus"

    def __init__(self, cfg, run_dir: Path, log: Callable[[str], None] = print):
        super().__init__()
        self.client = require("prometheus_client", "prometheus", "logging.prometheus_port")
        self.cfg, self.log = cfg, log
        self.latest = Latest(Path(run_dir).name)
        self.server = self.port = None

    def open(self, trainer) -> None:
        lcfg = self.cfg.logging
        registry = self.client.CollectorRegistry(auto_describe=False)
        registry.register(self.latest)
        try:
            self.server, _ = self.client.start_http_server(lcfg.prometheus_port, lcfg.prometheus_addr, registry)
        except OSError as e:  # a port in use (another run or exporter on this machine), an address not here
            raise ResourceError(
                f"cannot serve Prometheus metrics on {lcfg.prometheus_addr}:{lcfg.prometheus_port} "
                f"({e.strerror or e}): set logging.prometheus_port to a free port (0: any free one, logged) or "
                "logging.prometheus_addr to an address of this machine") from None
        self.port = self.server.server_port
        self.log(f"Prometheus metrics at http://{lcfg.prometheus_addr}:{self.port}/metrics")

    def write(self, step: int, values: dict[str, float], kind: str) -> None:
        self.latest.update({"step": float(step), **values} if kind == "train" else values, kind)

    def close(self, status: str) -> None:
        if self.server is not None:  # None: it never started (a port in use)
            self.server.shutdown()
            self.server.server_close()
