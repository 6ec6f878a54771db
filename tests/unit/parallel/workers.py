"""Code run in each process of the 2-process gloo tests (started by torchrun from the tests)."""

from __future__ import annotations

import json
import sys

import torch

from kiln.config import RunConfig
from kiln.model.registry import param_count
from kiln.parallel.materialize import build_model
from kiln.parallel.mesh import Mesh
from kiln.train.events import Callback
from kiln.train.trainer import Trainer

VOCAB, T, STEPS = 256, 16, 10


class GlobalBatches:
    """Sample k of the stream is a pure function of k; rank r of `world` takes the r-th slice of each global
    micro-batch of batch_size * world samples, as PackedLoader does."""

    def __init__(self, batch_size: int, rank: int = 0, world: int = 1):
        self.B, self.rank, self.world, self.sample = batch_size, rank, world, 0

    def __iter__(self):
        return self

    def __next__(self):
        lo = self.sample + self.rank * self.B
        rows = [torch.randint(0, VOCAB, (T + 1,), generator=torch.Generator().manual_seed(k))
                for k in range(lo, lo + self.B)]
        self.sample += self.B * self.world
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:], None

    def state_dict(self) -> dict:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict) -> None:
        self.sample = state["sample"]


class Losses(Callback):
    def __init__(self):
        self.losses, self.metrics = [], None

    def on_step_end(self, trainer, metrics):
        if metrics:
            self.losses.append(metrics["loss"])
            self.metrics = metrics


def config(batch_size: int, grad_accum: int, train: dict | None = None, model: dict | None = None,
           **dist) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": VOCAB, "max_seq_len": 64, **(model or {})},
        "train": {"seq_len": T, "batch_size": batch_size, "grad_accum": grad_accum, "max_steps": STEPS,
                  "warmup_steps": 2, "device": "cpu", "precision": "fp32", "lr": 3e-3, **(train or {})},
        "logging": {"every": 1}, "dist": dist,
    })


def train_losses(cfg: RunConfig, mesh: Mesh, save: str | None = None) -> tuple[list[float], dict, str]:
    """The logged loss of every step of a run of `cfg` on `mesh`; the last metrics (with `compiled_graphs`: the
    graphs torch's compiler made for the run); the strategy used. `save`: a file rank 0 writes the final weights
    to (a plain state dict, gathered from every rank under FSDP)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    logs: list[str] = []
    # FSDP: built on the meta device, each rank initialising its shard (the one-process weights)
    model = build_model(cfg, mesh, param_count(cfg.model), log=logs.append)
    record = Losses()
    trainer = Trainer(cfg, model, GlobalBatches(cfg.train.batch_size, mesh.rank, mesh.world), None, mesh.device,
                      [record], mesh=mesh)
    before = counters["aot_autograd"]["total"]
    trainer.train()
    if save is not None:
        from kiln.parallel.parallelize import full_model

        plain = full_model(trainer.model, cfg, mesh)
        if plain is not None:
            torch.save({k: v.detach().cpu() for k, v in plain.state_dict().items()}, save)
    metrics = {**record.metrics, "compiled_graphs": counters["aot_autograd"]["total"] - before}
    return record.losses, metrics, type(trainer.model).__name__


def run_cases(run) -> None:
    """The torchrun entry of a worker script: `run(case, mesh)` for each case of argv[2] (JSON), the results
    written by rank 0 to argv[1] (JSON, by case name)."""
    from kiln.parallel.mesh import init_mesh

    out, cases = sys.argv[1], json.loads(sys.argv[2])
    mesh = init_mesh("cpu", RunConfig().dist)
    results = {name: run(case, mesh) for name, case in cases.items()}
    if mesh.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    mesh.close(clean=True)


def run_case(case: dict, mesh):
    if case.get("worker") == "experts":  # expert parallelism's checkpoint and export (experts_worker.py)
        from experts_worker import ep_run

        return ep_run(case, mesh)
    return train_losses(
        config(case["batch_size"], case["grad_accum"], case.get("train"), case.get("model"), **case.get("dist", {})),
        mesh, case.get("save"))


def main() -> None:
    run_cases(run_case)

if __name__ == "__main__":
    main()
