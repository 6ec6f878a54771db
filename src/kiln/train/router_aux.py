"""`aux_loss` (and `router_z_loss`) in the metrics of a mixture-of-experts run: the auto path's
(kiln.model.hf_moe) and the native model's (kiln.model.moe).

The losses are summed on the device at each training forward (`RouterAux`) and read with the logging step's
loss, in its one all-reduce and host read (`Trainer.logged`): no sync or collective of their own."""

from __future__ import annotations

from kiln.events import Callback
from kiln.model.hf_moe import RouterAux


class RouterAuxLog(Callback):
    """Adds `aux_loss` (the mean over the steps since the last log, and over the processes) to each logging
    step's metrics, and `router_z_loss` likewise where `z` is given, before the sinks see them."""

    def __init__(self, aux: RouterAux, z: RouterAux | None = None):
        self.aux, self.z = aux, z

    def on_train_start(self, trainer) -> None:
        for name, losses in (("aux_loss", self.aux), ("router_z_loss", self.z)):
            if losses is not None:
                trainer.logged[name] = losses.take
