"""Prometheus: an HTTP endpoint on rank 0 with the latest value of every metric, for a cluster's scraper.

`GET http://HOST:PORT/metrics` answers metrics named after Prometheus' naming guide, each labelled with the
run directory's name: base units in the name's suffix (`_bytes`, `_seconds`, `_ratio` for a fraction
0-1, `_per_second`, `_watts`, `_celsius`, `_hertz`), values converted to them (a key in GiB, GB, MB/s,
percent or MHz is scaled), counters ending in `_total`. Training's metrics are `kiln_train_*`
(`kiln_train_loss`, `kiln_train_learning_rate`, `kiln_train_step`, the counter `kiln_train_tokens_total`),
the latest evaluation's `kiln_eval_*` (`kiln_eval_loss`, `kiln_eval_perplexity`, `kiln_eval_step`), the
resource monitor's as they are named (`kiln_rss_bytes`, `kiln_gpu_utilization_ratio`). The counter
`kiln_events_total{kind="rollback"}` counts the run's events by kind (rollback, early_stop, warning,
auto_batch, oom, ...); the gauge `kiln_last_update_timestamp_seconds` is the Unix time of the latest record:
`time() - kiln_last_update_timestamp_seconds > 600` finds a run that stopped logging, whatever its endpoint
still answers. Samples are not numbers and are left out.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from kiln.errors import ResourceError
from kiln.monitor.sinks.base import MetricSink, require

TRAIN = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "mfu", "data_wait"}  # train_
RENAMED = {"lr": "learning_rate", "ppl": "perplexity", "bpb": "bits_per_byte", "gpu_util": "gpu_utilization_percent",
           "mfu": "mfu_ratio", "data_wait": "data_wait_ratio"}
UNITS = [  # (pattern of a key, replacement, factor to base units)
    (r"(.*)_gib$", r"\1_bytes", 2.0 ** 30),
    (r"(.*)_gb$", r"\1_bytes", 1e9),
    (r"(.*)_gb_(\w+)$", r"\1_\2_bytes", 1e9),  # disk_free_gb_run
    (r"(.*)_mb_s$", r"\1_bytes_per_second", 1e6),
    (r"(.*)_percent$", r"\1_ratio", 0.01),
    (r"(.*)_frac$", r"\1_ratio", 1.0),
    (r"(.*)_w$", r"\1_watts", 1.0),
    (r"(.*)_c$", r"\1_celsius", 1.0),
    (r"(.*)_mhz$", r"\1_hertz", 1e6),
    (r"(.*)_per_s(_per_device)?$", r"\1_per_second\2", 1.0),
]


def metric_name(key: str, kind: str = "train") -> tuple[str, float]:
    """(the Prometheus name of a Kiln metric key of `kind` (train or eval), the factor to its base unit)."""
    if kind == "eval":
        base = key.removeprefix("val_")
        key = "eval_" + RENAMED.get(base, base)
    else:
        key = ("train_" if key in TRAIN else "") + RENAMED.get(key, key)
    key = re.sub(r"[^a-z0-9_]+", "_", key.replace("%", "_percent").lower()).strip("_")
    for pattern, repl, factor in UNITS:
        if re.fullmatch(pattern, key):
            return "kiln_" + re.sub(pattern, repl, key), factor
    return "kiln_" + key, 1.0


class Latest:
    """A prometheus_client collector of the latest values it was given (gauges), a counter of the tokens
    trained on and the time of the latest update."""

    def __init__(self, run: str, clock: Callable[[], float] = time.time):
        self.run, self.clock = run, clock
        self.values: dict[str, tuple[float, str]] = {}  # metric name -> (value, help)
        self.tokens = 0.0  # tokens trained on, the steps a rollback trains again counted again
        self.last_tokens: float | None = None
        self.updated: float | None = None
        self.events: dict[str, int] = {}  # notices by kind (rollback, warning, ...)

    def update(self, values: dict[str, float], kind: str) -> None:
        for k, v in values.items():
            if k == "tokens":  # tokens seen at the step: training's counter; an evaluation's copy is left out
                if kind == "train":
                    self._count(v)
                continue
            name, factor = metric_name(k, kind)
            self.values[name] = (v * factor, f"Kiln {kind} metric '{k}' in base units, latest value")
        self.updated = self.clock()

    def _count(self, seen: float) -> None:
        if self.last_tokens is None:
            self.tokens = seen  # a resumed run counts from the tokens it had seen
        elif seen > self.last_tokens:
            self.tokens += seen - self.last_tokens
        self.last_tokens = seen  # lower after a rollback: the steps trained again count from there

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, (value, doc) in sorted(self.values.items()):
            gauge = GaugeMetricFamily(name, doc, labels=["run"])
            gauge.add_metric([self.run], value)
            yield gauge
        if self.last_tokens is not None:
            counter = CounterMetricFamily("kiln_train_tokens", "Tokens trained on (the steps a rollback trains "
                                          "again count again)", labels=["run"])
            counter.add_metric([self.run], self.tokens)
            yield counter
        if self.events:
            counter = CounterMetricFamily("kiln_events", "Events of the run by kind: rollback, early_stop, warning, "
                                          "auto_batch, oom, ...", labels=["run", "kind"])
            for kind, n in sorted(self.events.items()):
                counter.add_metric([self.run, kind], n)
            yield counter
        if self.updated is not None:
            gauge = GaugeMetricFamily("kiln_last_update_timestamp_seconds", "Unix time of the run's latest "
                                      "train or eval record", labels=["run"])
            gauge.add_metric([self.run], self.updated)
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
        self.latest.update({"step": float(step), **values}, kind)

    def event(self, step: int, kind: str, text: str, info: dict) -> None:
        self.latest.events[kind] = self.latest.events.get(kind, 0) + 1

    def close(self, status: str) -> None:
        if self.server is not None:  # None: it never started (a port in use)
            self.server.shutdown()
            self.server.server_close()
