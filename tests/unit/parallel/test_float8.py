"""Float8 training (train.fp8) on the CPU: torchao's float8 layers in emulation (the float8 values multiplied in
high precision), which rounds as the GPU's float8 products do. The conversion keeps the state dict's names and
dtypes, leaves the output layer, the embeddings, routers and odd-sized layers alone, composes with activation
checkpointing, and trains; a CPU or a missing torchao is a clear error. The GPU runs: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.config import ModelConfig, load_config
from kiln.config.fp8 import Fp8Config
from kiln.errors import ConfigError
from kiln.model.llama import Transformer
from kiln.parallel import float8

CFG = ModelConfig(size="tiny", vocab_size=256, max_seq_len=64)
HERE = Path(__file__).parent


def _model(cfg: ModelConfig = CFG) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 32), generator=g)
    return x, x.roll(-1, 1)


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny products wait on each other's threads on a loaded machine (1 s a step with 2, 0.1 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def needs_torchao() -> None:
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'kiln[fp8]')")


def test_conversion_keeps_the_state_dict_rounds_like_float8_and_trains():
    needs_torchao()
    from kiln.parallel.ac import apply_ac

    x, y = _batch()
    plain = _model()
    want = {k: (v.dtype, v.shape) for k, v in plain.state_dict().items()}
    ref = plain(x, y).item()
    for recipe in ("tensorwise", "rowwise"):
        model = _model()
        names = float8.convert(model, Fp8Config(enabled=True, recipe=recipe), emulate=True)
        assert len(names) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
        assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
        assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == want  # checkpoints, exports
        first = model(x, y)
        assert first.item() != ref and first.item() == pytest.approx(ref, rel=0.02)  # float8-rounded, close
        first.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert all(g.abs().sum() > 0 for g in grads.values())
        checkpointed = apply_ac(_model(), "selective")  # the saved float8 products give the same gradients
        float8.convert(checkpointed, Fp8Config(enabled=True, recipe=recipe), emulate=True)
        checkpointed(x, y).backward()
        assert all(torch.equal(p.grad, grads[n]) for n, p in checkpointed.named_parameters())
        if recipe == "rowwise":  # trained on the GPU (tests/gpu/test_fp8_gpu.py)
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            opt.step()
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
        assert losses[-1] < first.item() - 1.0
        # after training: plain layers over the same tensors, as a bf16 run saves and samples
        before = {k: v.data_ptr() for k, v in model.state_dict().items()}
        assert float8.to_plain(model) == 14
        assert not [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
        assert model(x, y).item() == pytest.approx(losses[-1], rel=0.05)


class SameBatch:
    """A loader that gives one batch again and again (its loss falls in a few steps)."""

    def __init__(self):
        self.x, self.y = _batch()

    def __next__(self):
        return self.x, self.y, None

    def state_dict(self):
        return {}


def test_parallelize_converts_before_checkpointing_and_the_trainer_trains_it(monkeypatch):
    """Kiln's own path with torchao's real float8 products (torch's CPU _scaled_mm) under bf16 autocast."""
    needs_torchao()
    monkeypatch.syspath_prepend(str(HERE))
    from float8_worker import cpu_scaled_mm

    if not cpu_scaled_mm():  # declared before the run: a failure inside it fails the test
        pytest.skip("this torch has no float8 products (torch._scaled_mm) on the CPU")
    from kiln.config import RunConfig
    from kiln.parallel.mesh import Mesh
    from kiln.parallel.parallelize import parallelize
    from kiln.train.trainer import Trainer

    cfg = RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": 256, "max_seq_len": 64},
        "train": {"seq_len": 32, "batch_size": 4, "max_steps": 8, "warmup_steps": 1, "lr": 3e-3, "device": "cuda",
                  "precision": "bf16", "activation_checkpointing": "selective", "fp8": {"enabled": True}}})
    torch.manual_seed(0)
    said = []
    model = parallelize(_model(), cfg, Mesh(), log=said.append)
    assert said == ["train.fp8: 14 linear layers in float8, tensorwise scaling"]
    assert type(model.layers[1].mlp.down_proj).__name__ == "Float8Linear" and model.layers[1]._kiln_ac == "selective"
    trainer = Trainer(cfg, model, SameBatch(), None, torch.device("cpu"))
    assert not float8.scale_after_step(trainer.optimizer, model)  # one process: nothing gathered
    losses = [trainer.train_step()[0].item() for _ in range(8)]
    assert losses[-1] < losses[0] - 1.0


def test_layers_kept_in_bf16_and_why():
    needs_torchao()
    cfg = CFG.model_copy(update={"ffn_hidden": 200})  # 200 is no multiple of 16: the MLP stays
    model = _model(cfg)
    said = []
    names = float8.convert(model, Fp8Config(enabled=True, skip=[".v_proj"]), emulate=True, log=said.append)
    assert names == [f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qko"]
    assert type(model.layers[0].mlp.up_proj) is nn.Linear and type(model.layers[1].self_attn.v_proj) is nn.Linear
    assert said[0].startswith("train.fp8: 6 linear layers in float8, tensorwise scaling; kept in bf16")
    assert "mlp.up_proj: 64 x 200 is not a multiple of 16" in said[0]
    assert "self_attn.v_proj: train.fp8.skip has '.v_proj'" in said[0]
    said.clear()
    assert float8.convert(_model(cfg), Fp8Config(enabled=True, skip=["layers"]), emulate=True, log=said.append) == []
    assert said[0].startswith("warning: train.fp8: 0 linear layers") and said[0].endswith("trains in bf16")
    assert float8.keeps_bf16("layers.0.mlp.router", nn.Linear(64, 8)) == "a router"
    assert float8.keeps_bf16("layers.0.mlp.gate", nn.Linear(64, 16)) == "a router"
    assert float8.keeps_bf16("layers.0.mlp.gate_proj", nn.Linear(64, 128)) is None


def test_a_cpu_run_or_a_missing_torchao_is_a_config_error(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="needs a CUDA GPU with float8 tensor cores.*trains on the cpu"):
        float8.check_device("cpu")
    # train.device=auto on a machine without a GPU: refused at the start, before any data is prepared
    from kiln.train.run import run

    cfg = load_config(None, ["model.size=tiny", "train.fp8.enabled=true", f"train.run_dir={tmp_path / 'run'}",
                             f"data.cache_dir={tmp_path / 'cache'}", "train.device=auto"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.fp8.enabled=false to train in bf16"):
            run(cfg)
        assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"needs torchao.*pip install 'kiln\[fp8\]'"):
        float8.convert(_model(), Fp8Config(enabled=True))


def test_config_refuses_fp8_with_fp32_a_cpu_lora_or_a_transformers_model():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.fp8.enabled=true", "train.precision=fp32", "train.device=cpu"])
    assert "train.precision=fp32 asks for fp32" in str(e.value) and "train.device=cpu" in str(e.value)
    with pytest.raises(ConfigError, match="lora.rank > 0 trains another kind of model"):
        load_config(None, ["model.init_from=some/dir", "lora.rank=8", "train.fp8.enabled=true"])
    with pytest.raises(ConfigError, match="model.hf_class=auto trains another kind of model"):
        load_config(None, ["model.init_from=some/dir", "model.hf_class=auto", "train.fp8.enabled=true"])
    with pytest.raises(ConfigError, match="recipe"):
        load_config(None, ["train.fp8.recipe=blockwise"])
    cfg = load_config(None, ["train.fp8.enabled=true", "train.fp8.recipe=rowwise", "train.device=cuda:1"])
    assert cfg.train.fp8 == Fp8Config(enabled=True, recipe="rowwise")


@pytest.mark.slow
def test_fsdp_gathers_float8_weights_and_checkpoints_plain_ones(tmp_path):
    """Two gloo processes: FSDP2 gathers the float8 weights, their scales come after each step in one
    all-reduce and go with a load; the sharded checkpoint holds plain fp32 tensors under the plain names."""
    needs_torchao()
    from .test_parallelize import torchrun

    out = tmp_path / "out.json"
    done = torchrun([str(HERE / "float8_worker.py"), str(out), str(tmp_path / "ckpt")])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["gathers"] and got["keys_same"] and got["scales_after_step"] and got["scales_after_load"] is False
    assert got["plain_local"] == "Tensor" and got["loaded_equal"]
    assert got["losses"][-1] < got["losses"][0] - 0.5
    assert got["one_process_losses"] == pytest.approx(got["losses"], rel=2e-2)  # the same scaled products
    for f in (tmp_path / "ckpt").iterdir():  # read back without torchao
        assert b"torchao" not in f.read_bytes(), f.name
    kiln = got["kiln_path"]  # kiln.parallel.materialize.build_model and the Trainer, real float8 products
    if isinstance(kiln, str):
        pytest.skip(kiln)
    assert kiln["said"] == ["train.fp8: 14 linear layers in float8, tensorwise scaling (weights gathered in float8)"]
    assert kiln["gathered"] and kiln["losses"][-1] < kiln["losses"][0] - 0.5
    assert kiln["losses"] == pytest.approx(kiln["one_process_losses"], rel=2e-2)
