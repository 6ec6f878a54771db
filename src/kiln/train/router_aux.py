"""`aux_loss` in the metrics of a mixture-of-experts run on the auto path (kiln.model.hf_moe)."""

from __future__ import annotations

from typing import Any

from kiln.events import Callback
from kiln.model.hf_moe import RouterAux
from kiln.parallel.parallelize import reduce_mean


class RouterAuxLog(Callback):
    """Adds `aux_loss` (the mean over the steps since the last log, and over the processes) to each logging
    step's metrics; it runs before the sinks, which then show it."""

    def __init__(self, aux: RouterAux):
        self.aux = aux

    def on_step_end(self, trainer, metrics: dict[str, Any] | None) -> None:
        if metrics is None:
            return
        mean = self.aux.take()
        if mean is not None:
            metrics["aux_loss"] = float(reduce_mean(mean.reshape(1), trainer.mesh).item())
