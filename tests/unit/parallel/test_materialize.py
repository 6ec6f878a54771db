"""kiln.parallel.materialize: an FSDP model built on the meta device and initialised shard by shard holds the
weights of a one-process run's seeded init (or of model.init_from, read slice by slice), without any
process holding the whole model; one process and DDP skip the random init that init_from overwrites.
The per-parameter seeded draw of CUDA runs is checked here on the CPU generator, under a fake process
group of 2 and 3 ranks in this process (tests/gpu/test_init_gpu.py draws it on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.config import RunConfig
from kiln.model.hf import to_hf_config_dict, to_hf_state_dict
from kiln.model.llama import Transformer
from kiln.model.registry import param_count
from kiln.parallel.materialize import build_model, init_seeded, local_slices, materialize, param_seed
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import parallelize

HERE = Path(__file__).parent


def config(**model) -> dict:
    return {"model": {"size": "tiny", "vocab_size": 2048, "d_model": 256, "n_layers": 8, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_hidden": 768, "max_seq_len": 64, **model},
            "train": {"device": "cpu", "precision": "fp32", "seed": 7, "seq_len": 32}, "dist": {"strategy": "fsdp"}}


def one_process(cfg: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor, Transformer]:
    rc = RunConfig.model_validate(cfg)
    torch.manual_seed(rc.train.seed)
    model = Transformer(rc.model)
    return model.state_dict(), torch.rand(4), model


def torchrun_build(tmp_path: Path, cfg: dict, *extra: str) -> dict:
    """The build of `cfg` by 2 processes; with an HF directory in `extra`, the same job's second build from it
    under the key "init_from"."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "build_worker.py"), str(tmp_path), json.dumps(cfg), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "built.pt", weights_only=False)
    if extra:
        got["init_from"] = torch.load(tmp_path / "built_init_from.pt", weights_only=False)
    return got


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[dict, Transformer]:
    """One 2-process job: the seeded build of the untied model (measured), then a build from an HF directory
    of other weights (seed 123); and the model those weights came from."""
    cfg = config(tie_embeddings=False)
    _, _, source = one_process({**cfg, "train": {**cfg["train"], "seed": 123}})
    root = tmp_path_factory.mktemp("untied")
    hf = write_hf_dir(root / "hf", source)
    (root / "out").mkdir()
    return torchrun_build(root / "out", cfg, str(hf)), source


def write_hf_dir(path: Path, model: Transformer) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(model.cfg)))
    state = to_hf_state_dict({k: v.contiguous() for k, v in model.state_dict().items()}, model.cfg.tie_embeddings)
    save_file(state, str(path / "model.safetensors"))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False])
def test_fsdp_meta_build_equals_the_one_process_init_and_stays_bounded(tmp_path, tie, request):
    cfg = config(tie_embeddings=tie)
    expected, rng_after, model = one_process(cfg)
    got = torchrun_build(tmp_path, cfg) if tie else request.getfixturevalue("untied")[0]
    assert got["kinds"] == ["DTensor"] and got["tied"] is tie  # DTensor parameters; ties kept
    assert sorted(got["state"]) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(got["state"][k], v), k  # bit for bit
    torch.testing.assert_close(got["rope"][0], model.rope_cos)
    torch.testing.assert_close(got["rope"][1], model.rope_sin)
    assert torch.equal(got["rng_after"], rng_after)  # the generator moved on as in one process
    # no process held the whole model: each grew by its half plus the one full parameter being drawn
    whole = 4 * param_count(RunConfig.model_validate(cfg).model)
    largest = 4 * max(p.numel() for p in model.parameters())
    assert whole > 10 * largest
    for grew in got["rss_growth"]:
        assert grew < whole / 2 + largest + 0.1 * whole, (grew, whole)


@pytest.mark.slow
def test_fsdp_init_from_reads_each_shard_from_the_safetensors(untied):
    got, source = untied
    got = got["init_from"]
    assert got["kinds"] == ["DTensor"]
    for k, v in source.state_dict().items():
        assert torch.equal(got["state"][k], v), k


def test_one_process_with_init_from_skips_the_random_init(tmp_path):
    cfg = config(tie_embeddings=True)
    _, _, source = one_process(cfg)
    hf = write_hf_dir(tmp_path / "hf", source)
    rc = RunConfig.model_validate({**cfg, "dist": {}})
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    model = build_model(rc, Mesh(), param_count(rc.model), weights_from=str(hf))
    assert torch.equal(torch.get_rng_state(), rng)  # no random number drawn: no init to overwrite
    assert model.lm_head.weight is model.embed_tokens.weight
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    torch.testing.assert_close(model.rope_cos, source.rope_cos)


def test_a_safetensors_tensor_of_the_wrong_shape_is_a_state_error(tmp_path):
    from kiln.errors import StateError
    from kiln.parallel.materialize import load_shards

    cfg = RunConfig.model_validate(config(tie_embeddings=True))
    _, _, source = one_process(config(tie_embeddings=True, ffn_hidden=512))
    hf = write_hf_dir(tmp_path / "hf", source)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device="cpu")
    shape = r"model.layers.0.mlp.down_proj.weight has shape \[256, 512\], the model expects \[256, 768\]"
    with pytest.raises(StateError, match=shape):
        load_shards(model, hf, False, True)


def test_a_resume_builds_without_a_random_init_but_with_rope_tables_and_ties():
    rc = RunConfig.model_validate({**config(tie_embeddings=True), "dist": {}})
    _, _, reference = one_process(config(tie_embeddings=True))
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    model = build_model(rc, Mesh(), param_count(rc.model), init=False)  # the checkpoint brings the weights
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin)


def fake_rank_shards(cfg: dict, world: int, rank: int, draw) -> dict[str, tuple[tuple[slice, ...], torch.Tensor]]:
    """Rank `rank` of `world`: the FSDP model sharded on the meta device, materialised on the CPU and
    initialised by `draw(model)`; its (slices, local shard) per parameter name. A fake process group (no peers,
    no collectives) stands in for the others: the init itself needs none."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rc = RunConfig.model_validate(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # a name of its own: torch caches meshes by shape and names, and would hand back the last rank's
        grid = init_device_mesh("cpu", (world,), mesh_dim_names=(f"dp_of_rank_{rank}",))
        m = Mesh(rank, rank, world, world, torch.device("cpu"), "fake", grid)
        with torch.device("meta"):
            model = Transformer(rc.model)
        model = parallelize(model, rc, m, param_count(rc.model), lambda s: None, strategy="fsdp")
        materialize(model, m)
        draw(model)
        return {n: (local_slices(p), p.to_local().detach().clone()) for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


def put_together(world: int, cfg: dict, draw, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameters (shaped as in `like`) assembled from the shards of every rank of `world`."""
    full = {name: torch.full_like(like[name], float("nan")) for name in like}
    for rank in range(world):
        for name, (rows, local) in fake_rank_shards(cfg, world, rank, draw).items():
            full[name][rows] = local
    return full


def seeded_one_process(cfg: dict, seed: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(RunConfig.model_validate(cfg).model)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_seeded(model, "cpu", seed)
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_the_seeded_init_is_the_same_on_any_world_size(world):
    """The CUDA path's draw, here from CPU generators: each rank draws every parameter full-size from the
    generator of its own seed (param_seed(train.seed, place)) and keeps its rows, so the shards of 2 or 3
    ranks (3: uneven, padded) put together are the one-process tensors bit for bit."""
    cfg = config(tie_embeddings=False, n_layers=2)
    expected = {n: p.detach() for n, p in seeded_one_process(cfg, 7).named_parameters()}
    got = put_together(world, cfg, lambda m: init_seeded(m, "cpu", 7), expected)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name


def test_each_parameter_of_the_seeded_init_depends_on_its_seed_place_and_shape_only():
    """The seed per parameter: a parameter's values do not depend on how many were drawn before it (a
    deeper model keeps the first block's weights, the residual projections scaled by its 1/sqrt(2 * n_layers)),
    nor on the other generators; another seed changes them."""
    two, three = seeded_one_process(config(n_layers=2), 7), seeded_one_process(config(n_layers=3), 7)
    deeper = dict(three.layers[0].named_parameters())
    for name, p in two.layers[0].named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(p * (3 / 2) ** -0.5, deeper[name])
        else:
            assert torch.equal(p, deeper[name]), name
    g = torch.Generator().manual_seed(param_seed(7, 0))
    assert torch.equal(two.embed_tokens.weight, torch.empty_like(two.embed_tokens.weight).normal_(0, two.cfg.init_std,
                                                                                                    generator=g))
    assert not torch.equal(two.layers[0].self_attn.q_proj.weight, two.layers[0].self_attn.k_proj.weight[:256])
    other = seeded_one_process(config(n_layers=2), 8)
    assert not torch.equal(two.embed_tokens.weight, other.embed_tokens.weight)
    assert len({param_seed(7, i) for i in range(100)} | {param_seed(8, i) for i in range(100)}) == 200


def test_the_global_stream_init_is_the_same_on_any_world_size_too():
    """The CPU path (build_model on a CPU run) under the fake group: the one-process weights, in 3 shards."""
    from kiln.parallel.materialize import init_shards

    cfg = config(tie_embeddings=False, n_layers=2)
    _, _, reference = one_process(cfg)
    expected = {n: p.detach() for n, p in reference.named_parameters()}

    def draw(model):
        torch.manual_seed(7)
        init_shards(model, "cpu")

    got = put_together(3, cfg, draw, expected)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_reads_each_experts_rows_from_per_expert_tensors(tmp_path, kind):
    """FSDP with init_from: a rank's rows of a stacked expert parameter (4 experts over 3 ranks: 2, 2, 0) are read
    from the checkpoint's one tensor per expert (Mixtral's w1/w3/w2 under block_sparse_moe, or Qwen's names); the
    shards put together are the model's weights; a checkpoint that lacks an expert is refused."""
    from safetensors.torch import save_file

    from kiln.errors import StateError
    from kiln.parallel.materialize import load_shards

    moe = {"n_experts": 4, "top_k": 2, "expert_hidden": 64}
    cfg = config(tie_embeddings=False, n_layers=2, moe=moe, qk_norm=kind == "qwen3_moe", hf_model_type=kind)
    source = Transformer(RunConfig.model_validate(cfg).model)
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(to_hf_config_dict(source.cfg)))
    state = to_hf_state_dict({k: v.contiguous() for k, v in source.state_dict().items()}, False, kind=kind)
    assert ("model.layers.1.block_sparse_moe.experts.3.w2.weight" in state) == (kind == "mixtral")
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    expected = {n: p.detach() for n, p in source.named_parameters()}
    got = put_together(3, cfg, lambda m: load_shards(m, path, False, False), expected)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
    missing = next(k for k in state if ".experts.3." in k)
    save_file({k: v.contiguous() for k, v in state.items() if k != missing}, str(path / "model.safetensors"))
    with pytest.raises(StateError, match="missing .*experts"):
        put_together(2, cfg, lambda m: load_shards(m, path, False, False), expected)
