"""Code run in each process of the 2-process gloo LoRA tests (started by torchrun from test_lora_dist.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from workers import GlobalBatches, Losses, config, run_cases  # noqa: E402

from kiln.config import LoraConfig  # noqa: E402
from kiln.model.llama import Transformer  # noqa: E402
from kiln.model.lora import adapter_state_dict, apply_lora, is_adapter_key  # noqa: E402
from kiln.parallel.mesh import Mesh  # noqa: E402
from kiln.parallel.parallelize import full_model, parallelize  # noqa: E402
from kiln.state.parts import ModelState  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402


def lora_run(case: dict, mesh: Mesh) -> dict:
    """Train the tiny model with LoRA on `mesh`: the losses, the checkpoint part's keys, the gathered adapters."""
    cfg = config(case["batch_size"], case["grad_accum"], model=case.get("model"), **case.get("dist", {}))
    cfg = cfg.model_copy(update={"lora": LoraConfig(**case["lora"])})
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update=case.get("train", {}))})
    torch.manual_seed(0)
    if cfg.lora.quantize_base == "nf4":  # QLoRA: the base built on the device a block at a time, in NF4
        from kiln.parallel.nf4_base import nf4_model

        model = apply_lora(nf4_model(cfg, mesh.device), cfg.lora)
    else:
        model = apply_lora(Transformer(cfg.model), cfg.lora)
    model = parallelize(model, cfg, mesh, log=lambda _: None)
    record = Losses()
    trainer = Trainer(cfg, model, GlobalBatches(cfg.train.batch_size, mesh.rank, mesh.world), None, mesh.device,
                      [record], mesh=mesh)
    trainer.train()
    part = sorted(ModelState(trainer.model).state_dict())
    full = full_model(trainer.model, cfg, mesh)  # every rank takes part
    adapters = {k: v.float().sum().item() for k, v in adapter_state_dict(full).items()} if full is not None else {}
    frozen = sorted(k for k, v in full.named_parameters() if not v.requires_grad) if full is not None else []
    return {"losses": record.losses, "part": part, "adapters": adapters, "wrapper": type(trainer.model).__name__,
            "frozen_ok": all(not is_adapter_key(k) for k in frozen)}


def main() -> None:
    run_cases(lora_run)

if __name__ == "__main__":
    main()
