"""kiln.parallel.materialize on a GPU: an FSDP model's init is drawn on CUDA, one generator per parameter, holding
one full parameter at a time on the device, with the same weights on any world size (a fake process group
of 2 ranks in this process: the shards it keeps are placed on the CPU, the draw itself is on the GPU)."""

from __future__ import annotations

import pytest
import torch

from kiln.config import RunConfig
from kiln.model.llama import Transformer
from kiln.model.registry import param_count
from kiln.parallel.materialize import build_model, init_seeded, local_slices, materialize, param_seed
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import parallelize

pytestmark = pytest.mark.gpu

MODEL = {"size": "tiny", "vocab_size": 32000, "d_model": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
         "ffn_hidden": 1536, "max_seq_len": 64, "tie_embeddings": False}


def config(device: str) -> RunConfig:
    return RunConfig.model_validate({"model": MODEL, "dist": {"strategy": "fsdp"},
                                     "train": {"device": device, "precision": "fp32", "seed": 7, "seq_len": 32}})


def empty(device: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config(device).model)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def test_the_cuda_init_draws_each_parameter_from_its_own_generator_one_at_a_time():
    model = empty("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    init_seeded(model, "cuda", 7)
    grew = torch.cuda.max_memory_allocated() - before
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert grew <= largest + (1 << 20), (grew, largest)  # one full parameter beside the model, no more
    g = torch.Generator("cuda").manual_seed(param_seed(7, 0))
    want = torch.empty_like(model.embed_tokens.weight).normal_(0, model.cfg.init_std, generator=g)
    assert torch.equal(model.embed_tokens.weight, want)
    again = empty("cuda")
    init_seeded(again, "cuda", 7)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    torch.manual_seed(7)
    on_cpu = Transformer(config("cpu").model)  # a one-process CPU init: another generator, other values
    assert not torch.equal(model.embed_tokens.weight.cpu(), on_cpu.embed_tokens.weight)
    assert abs(model.embed_tokens.weight.std().item() - model.cfg.init_std) < 1e-3


def test_the_cuda_init_is_the_same_on_two_ranks_as_on_one():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    whole = empty("cuda")
    init_seeded(whole, "cuda", 7)
    expected = {n: p.detach().cpu() for n, p in whole.named_parameters()}
    got = {n: torch.full_like(v, float("nan")) for n, v in expected.items()}
    rc = config("cpu")
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            grid = init_device_mesh("cpu", (2,), mesh_dim_names=(f"dp_of_rank_{rank}",))
            m = Mesh(rank, rank, 2, 2, torch.device("cpu"), "fake", grid)
            with torch.device("meta"):
                model = Transformer(rc.model)
            model = parallelize(model, rc, m, param_count(rc.model), lambda s: None, strategy="fsdp")
            materialize(model, m)
            init_seeded(model, "cuda", 7)  # drawn on the GPU, the rank's rows kept on the CPU (as cpu_offload)
            for name, p in model.named_parameters():
                got[name][local_slices(p)] = p.to_local()
        finally:
            dist.destroy_process_group()
    for name, want in expected.items():
        assert torch.equal(got[name], want), name


def test_one_process_on_cuda_keeps_the_cpu_init():
    """One process (and DDP) build the whole model on the CPU as before: the weights of a CPU run."""
    rc = config("cuda")
    torch.manual_seed(7)
    model = build_model(rc, Mesh(device=torch.device("cuda")), param_count(rc.model), lambda s: None)
    torch.manual_seed(7)
    reference = Transformer(rc.model)
    assert model.embed_tokens.weight.device.type == "cuda"
    assert torch.equal(model.embed_tokens.weight.cpu(), reference.embed_tokens.weight)
