"""kiln.dist.materialize: an FSDP model built on the meta device and initialised shard by shard holds the
weights of a one-process run's seeded init (or of model.init_from, read slice by slice), without any
process holding the whole model; one process and DDP skip the random init that init_from overwrites."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.config import RunConfig
from kiln.dist.materialize import build_model
from kiln.dist.mesh import Mesh
from kiln.model.hf import to_hf_config_dict, to_hf_state_dict
from kiln.model.llama import Transformer
from kiln.model.registry import param_count

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
    from kiln.dist.materialize import load_shards
    from kiln.errors import StateError

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
