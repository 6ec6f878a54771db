"""Code run in each process of the 2-process gloo expert-parallelism test (started by torchrun from
test_experts.py): a tiny mixture of experts trained under FSDP with and without dist.expert_parallel=2."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from workers import GlobalBatches, Losses, config, run_cases  # noqa: E402

from kiln.model.registry import param_count  # noqa: E402
from kiln.parallel.materialize import build_model  # noqa: E402
from kiln.parallel.mesh import Mesh  # noqa: E402
from kiln.parallel.parallelize import full_model  # noqa: E402
from kiln.state.checkpointer import Checkpointer  # noqa: E402
from kiln.train.events import Callback  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402

MOE = {"d_model": 32, "n_heads": 4, "n_kv_heads": 2, "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16}}
STEPS, SAVE_AT = 4, 2


class Norms(Losses):
    def __init__(self):
        super().__init__()
        self.norms = []

    def on_step_end(self, trainer, metrics):
        super().on_step_end(trainer, metrics)
        if metrics:
            self.norms.append(metrics["grad_norm"])


class SaveAt(Callback):
    def __init__(self, ck: Checkpointer, step: int):
        self.ck, self.step = ck, step

    def on_step_end(self, trainer, metrics):
        if trainer.step == self.step:
            self.ck.save(trainer, blocking=True)


def _trainer(cfg, mesh: Mesh, callbacks: list) -> Trainer:
    torch.manual_seed(0)
    model = build_model(cfg, mesh, param_count(cfg.model), log=lambda _: None)
    return Trainer(cfg, model, GlobalBatches(cfg.train.batch_size, mesh.rank, mesh.world), None, mesh.device,
                   callbacks, mesh=mesh)


def ep_run(case: dict, mesh: Mesh) -> dict:
    """Train STEPS steps of 2 sequences a rank (in `grad_accum` micro-batches), a checkpoint at SAVE_AT; with
    `resume`, train again from that checkpoint. Returns the losses, gradient norms, the resumed losses, the experts'
    layout on this rank and the compiled graphs; rank 0 writes the export (export.pt)."""
    from torch._dynamo.utils import counters

    accum = case.get("grad_accum", 1)
    cfg = config(2 // accum, accum, train={"max_steps": STEPS, **case.get("train", {})}, model=MOE, strategy="fsdp",
                 expert_parallel=case["expert_parallel"])
    root = Path(case["dir"])
    ck = Checkpointer(root / "run", cfg, {}, lambda _: None)
    record = Norms()
    trainer = _trainer(cfg, mesh, [record, SaveAt(ck, SAVE_AT)])
    trainer.train()
    graphs = counters["aot_autograd"]["total"]
    experts = trainer.model.layers[0].mlp.experts
    out = {"losses": record.losses, "norms": record.norms, "experts": type(experts).__name__,
           "local_experts": tuple(experts.gate_up_proj.to_local().shape)[0],
           "graphs": graphs}
    plain = full_model(trainer.model, cfg, mesh)
    if plain is not None:
        torch.save({k: v.detach().cpu() for k, v in plain.state_dict().items()}, root / "export.pt")
    if case.get("resume"):
        again = Losses()
        resumed = _trainer(cfg, mesh, [again])
        ck.load(resumed, root / "run" / "checkpoints" / f"step_{SAVE_AT:08d}")
        resumed.train()
        out["resumed"] = again.losses
    ck.close()
    return out


def main() -> None:
    run_cases(ep_run)

if __name__ == "__main__":
    main()
