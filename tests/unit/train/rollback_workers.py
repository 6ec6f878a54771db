"""Run in each of the 2 gloo processes of test_rollback_dist (started by torchrun): runs of the tiny model under
DDP, with and without rollback, counting the all-reduces kiln makes at each step. Each rank writes its results
(JSON, by case name) to argv[1] with its rank appended."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from healing import Notices, Numerics, Samples, config  # noqa: E402

from kiln.events import Callback  # noqa: E402
from kiln.model.registry import param_count  # noqa: E402
from kiln.parallel.materialize import build_model  # noqa: E402
from kiln.parallel.mesh import Mesh, init_mesh  # noqa: E402
from kiln.parallel.parallelize import unwrap  # noqa: E402
from kiln.state.snapshot import MemorySnapshots  # noqa: E402
from kiln.train.rollback import Rollback  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402

REDUCES: list[int] = []  # one entry per torch.distributed.all_reduce call
_all_reduce = dist.all_reduce


def counting_all_reduce(*args, **kwargs):
    REDUCES.append(1)
    return _all_reduce(*args, **kwargs)


dist.all_reduce = counting_all_reduce  # kiln.parallel.parallelize.reduce_mean calls dist.all_reduce


class PerStep(Callback):
    """The all-reduces made since the end of the step before, and the logged metrics, by step."""

    def __init__(self):
        self.reduces, self.metrics = {}, {}

    def on_train_start(self, trainer):
        REDUCES.clear()

    def on_step_end(self, trainer, metrics):
        self.reduces[trainer.step] = len(REDUCES)
        REDUCES.clear()
        if metrics:
            self.metrics[trainer.step] = {k: metrics[k] for k in ("loss", "grad_norm", "tokens")}


def run(case: dict, mesh: Mesh, run_dir: Path) -> dict:
    rcfg = {"snapshot_every": 8, "spike_window": 5, "spike_zscore": 6.0}
    cfg = config(run_dir, steps=16, recovery=rcfg, log_every=case["log_every"])
    per, log = PerStep(), Notices()
    callbacks = [per, log]
    if case["rollback"]:
        callbacks.insert(0, Rollback(cfg.recovery, MemorySnapshots(lambda m: None)))
    torch.manual_seed(0)
    model = build_model(cfg, mesh, param_count(cfg.model), log=lambda m: None)
    Numerics(unwrap(model), case.get("scale"))
    loader = Samples(cfg.train.batch_size, case.get("poison", ()), mesh.rank, mesh.world)
    t = Trainer(cfg, model, loader, None, mesh.device, callbacks, mesh=mesh)
    t.train()
    digest = hashlib.sha256()
    for v in unwrap(t.model).state_dict().values():
        digest.update(v.detach().contiguous().numpy().tobytes())
    return {"wrapper": type(t.model).__name__, "step": t.step, "reduces": per.reduces, "metrics": per.metrics,
            "rollbacks": [info for kind, info in log.notices if kind == "rollback"], "weights": digest.hexdigest()}


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    mesh = init_mesh("cpu", config(".").dist, log=lambda m: None)
    results = {name: run(case, mesh, Path(out).parent / name) for name, case in cases.items()}
    with open(f"{out}{mesh.rank}", "w") as f:
        json.dump(results, f)
    mesh.close(clean=True)


if __name__ == "__main__":
    main()
