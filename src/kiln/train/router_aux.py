"""`aux_loss` (and `router_z_loss`) in the metrics of a mixture-of-experts run: the auto path's
(kiln.model.hf_moe) and the native model's (kiln.model.moe)."""

from __future__ import annotations

from typing import Any

from kiln.events import Callback
from kiln.model.hf_moe import RouterAux
from kiln.parallel.parallelize import reduce_mean


class RouterAuxLog(Callback):
    """Adds `aux_loss` (the mean over the steps since the last log, and over the processes) to each logging
    step's metrics, and `router_z_loss` likewise where `z` is given; it runs before the sinks, which then show it."""

    def __init__(self, aux: RouterAux, z: RouterAux | None = None):
        self.aux, self.z = aux, z

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if metrics is None:
            return
        for name, losses in (("aux_loss", self.aux), ("router_z_loss", self.z)):
            mean = losses.take() if losses is not None else None
            if mean is not None:
                metrics[name] = float(reduce_mean(mean.reshape(1), trainer.mesh).item())
