"""Each process of the 2-process gloo float8 test (tests/unit/parallel/test_float8.py): the tiny model with
float8 layers (emulated), sharded by FSDP2 with float8 gathers, trained, checkpointed with DCP and loaded back.
Writes what it found to argv[1] (rank 0); the checkpoint goes to argv[2]."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kiln.config import ModelConfig
from kiln.config.fp8 import Fp8Config
from kiln.model.llama import Transformer
from kiln.parallel import float8

CFG = ModelConfig(size="tiny", vocab_size=256, max_seq_len=64)
STEPS = 6


def batches(rank: int, world: int):
    """Step k's global batch of 4 rows (two batches in turn: the loss falls in a few steps); this rank's slice."""
    for k in range(STEPS):
        x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(k % 2))
        rows = x[rank * 4 // world:(rank + 1) * 4 // world]
        yield rows[:, :-1], rows[:, 1:]


def train(model, rank: int, world: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    float8.scale_after_step(opt, model)
    losses = []
    for x, y in batches(rank, world):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        summed = loss.detach().clone()
        if world > 1:
            dist.all_reduce(summed)
        losses.append(summed.item() / world)
    return losses


def local_scale(model):
    return model.layers[0].self_attn.q_proj.weight._local_tensor._precomputed_scale


def main(out: str, ckpt: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    fp8 = Fp8Config(enabled=True)

    torch.manual_seed(0)
    one = Transformer(CFG)  # one process's reference: the same weights, the whole batch
    float8.convert(one, fp8, emulate=True)
    one_losses = train(one, 0, 1)

    torch.manual_seed(0)
    model = Transformer(CFG)
    keys = list(model.state_dict())
    float8.convert(model, fp8, fsdp=True, emulate=True)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = train(model, rank, world)
    found = {"gathers": float8.gathers_float8(model), "scales_after_step": local_scale(model) is not None,
             "losses": losses, "one_process_losses": one_losses}
    state = get_model_state_dict(model)
    weight = state["layers.0.self_attn.q_proj.weight"]
    found["keys_same"] = list(state) == keys
    found["plain_local"] = type(weight._local_tensor).__name__
    dcp.save(state, checkpoint_id=ckpt)
    saved = {k: v.full_tensor() for k, v in state.items()}

    torch.manual_seed(1)  # other weights, then the checkpoint's
    other = Transformer(CFG)
    float8.convert(other, fp8, fsdp=True, emulate=True)
    for block in other.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(other, mesh=mesh)
    opt = torch.optim.AdamW(other.parameters(), lr=3e-3)
    float8.scale_after_step(opt, other)
    x, y = next(batches(rank, world))
    other(x, y).backward()
    opt.step()  # a scale of the old weights
    loaded = get_model_state_dict(other)
    dcp.load(loaded, checkpoint_id=ckpt)
    set_model_state_dict(other, loaded)
    found["scales_after_load"] = local_scale(other) is not None
    found["loaded_equal"] = all(torch.equal(v.full_tensor(), saved[k])
                                for k, v in get_model_state_dict(other).items())
    found["kiln_path"] = kiln_path(rank, world, mesh)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


def cpu_scaled_mm() -> bool:
    """Whether this torch multiplies float8 matrices on the CPU (torch._scaled_mm)."""
    one = torch.ones((), dtype=torch.float32)
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Rows:
    """This rank's share of one global batch of 4 rows, again and again."""

    def __init__(self, rank: int, world: int):
        x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(7))
        self.rows = x[rank * 4 // world:(rank + 1) * 4 // world]

    def __next__(self):
        return self.rows[:, :-1], self.rows[:, 1:], None

    def state_dict(self) -> dict:
        return {}


def kiln_path(rank: int, world: int, device_mesh) -> dict | str:
    """Kiln's own FSDP build (meta device, float8 layers, sharding, each shard initialised in place) and Trainer,
    with real float8 products under bf16 autocast, against the same build in one process."""
    if not cpu_scaled_mm():
        return "skipped: no float8 products on this CPU"
    from kiln.config import RunConfig
    from kiln.model.registry import param_count
    from kiln.parallel.materialize import build_model
    from kiln.parallel.mesh import Mesh
    from kiln.parallel.parallelize import reduce_mean
    from kiln.train.trainer import Trainer

    cfg = RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": 256, "max_seq_len": 64},
        "train": {"seq_len": 32, "batch_size": 4 // world, "max_steps": STEPS, "warmup_steps": 1, "lr": 3e-3,
                  "device": "cuda", "precision": "bf16", "fp8": {"enabled": True}},
        "dist": {"strategy": "fsdp"}})
    cpu = torch.device("cpu")
    mesh = Mesh(rank=rank, local_rank=rank, world=world, local_world=world, device=cpu, backend="gloo",
                mesh=device_mesh)
    said: list[str] = []
    torch.manual_seed(0)
    model = build_model(cfg, mesh, param_count(cfg.model), log=said.append)
    trainer = Trainer(cfg, model, Rows(rank, world), None, cpu, mesh=mesh)
    gathered = float8.scale_after_step(trainer.optimizer, model)
    losses = [reduce_mean(trainer.train_step()[0].detach(), mesh).item() for _ in range(STEPS)]

    one_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": 4})})
    torch.manual_seed(0)
    single = build_model(one_cfg, Mesh(device=cpu), param_count(cfg.model), log=lambda _: None)
    ref = Trainer(one_cfg, single, Rows(0, 1), None, cpu, mesh=Mesh(device=cpu))
    one = [ref.train_step()[0].item() for _ in range(STEPS)]
    return {"said": said, "gathered": gathered, "losses": losses, "one_process_losses": one}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
