"""NF4 quantization of a QLoRA base: what is quantized, how close it stays, its bytes, and the errors said
for a layer that cannot be quantized or a missing torchao."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn

from kiln.config import LoraConfig, ModelConfig
from kiln.errors import ConfigError
from kiln.model.llama import Transformer
from kiln.model.lora import apply_lora, merge_lora, training_bytes
from kiln.model.quant import BYTES_PER_WEIGHT, is_nf4, param_bytes, quantize, quantize_block, round_trip, scaler_block

pytest.importorskip("torchao")
CFG = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def test_round_trip_stays_within_half_a_level_of_each_blocks_scale():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    back = round_trip(w, torch.float32)
    blocks, err = w.reshape(-1, 64), (back - w).reshape(-1, 64)
    # NF4's widest gap between levels is 0.304 of the block's absmax (its scale is itself int8-quantized)
    assert (err.abs().amax(1) <= 0.16 * blocks.abs().amax(1) + 1e-6).all()
    assert err.pow(2).mean().sqrt() < 0.12 * w.std()
    assert not torch.equal(back, w) and back.shape == w.shape
    q = quantize(w, torch.bfloat16)
    assert is_nf4(q) and not is_nf4(w) and q.dtype == torch.bfloat16
    assert torch.equal(q.get_original_weight(), quantize(w, torch.bfloat16).get_original_weight())  # deterministic


def test_scale_blocks_fit_small_layers_and_bytes_are_a_half_and_a_bit():
    assert scaler_block(4096 * 4096) == 256 and scaler_block(64 * 64) == 64 and scaler_block(96 * 64) == 32
    q = quantize(torch.randn(64, 64), torch.bfloat16)
    assert param_bytes(q) == 4096 * BYTES_PER_WEIGHT and 0.51 < BYTES_PER_WEIGHT < 0.52
    assert param_bytes(torch.zeros(10, dtype=torch.bfloat16)) == 20


def test_every_block_linear_is_quantized_and_frozen_adapters_train_on_it():
    torch.manual_seed(0)
    model = Transformer(CFG)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.layers):
        quantize_block(block, torch.bfloat16, f"layers.{i}")
    lcfg = LoraConfig(rank=4, targets=["q", "v"], quantize_base="nf4")
    apply_lora(model, lcfg)
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert nf4 == {f"layers.{i}.{p}.weight" for i in range(2) for p in
                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                    "mlp.up_proj", "mlp.down_proj")}
    x = torch.randint(0, 96, (2, 16))
    loss = model(x, x)
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, _ in model.named_parameters() if ".lora_" in n}
    merged = merge_lora(model)  # the dequantized base, in fp32
    for name in nf4:
        torch.testing.assert_close(merged.state_dict()[name], round_trip(plain[name], torch.bfloat16).float(),
                                   rtol=0, atol=0)
    # 14 NF4 layers at 0.52 bytes a weight, the rest in bf16, the adapters at 16 bytes a parameter
    n_nf4 = sum(p.numel() for n, p in model.named_parameters() if n in nf4)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if n not in nf4 and ".lora_" not in n)
    assert training_bytes(model) == int(n_nf4 * BYTES_PER_WEIGHT + 16 * adapters + 2 * rest)


def test_a_hybrid_models_mixers_are_quantized_and_adapters_on_mamba_train():
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128, mlp="relu2",
                      layer_pattern="M*-", mamba=dict(head_dim=16, state=8, groups=2, chunk=8))
    torch.manual_seed(0)
    model = Transformer(cfg)
    for i, block in enumerate(model.layers):
        quantize_block(block, torch.bfloat16, f"layers.{i}")
    apply_lora(model, LoraConfig(rank=4, targets=["in_proj", "out_proj", "q"], quantize_base="nf4"))
    nf4 = {n for n, p in model.named_parameters() if is_nf4(p)}
    assert nf4 == {f"layers.{i}.mixer.{p}.weight" for i, names in enumerate(
        [("in_proj", "out_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("up_proj", "down_proj")]) for p in names}
    x = torch.randint(0, 96, (2, 16))
    model(x, x).backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == {
        n for n, _ in model.named_parameters() if ".lora_" in n}


def test_a_layer_of_no_whole_block_is_a_config_error_naming_it():
    block = nn.Module()
    block.self_attn = nn.Module()
    block.self_attn.q_proj = nn.Linear(10, 10, bias=False)
    with pytest.raises(ConfigError, match=r"layers\.3\.self_attn\.q_proj\.weight: its 100 weights"):
        quantize_block(block, torch.bfloat16, "layers.3")


def test_without_torchao_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    monkeypatch.setitem(sys.modules, "torchao.dtypes.nf4tensor", None)
    with pytest.raises(ConfigError, match=r"pip install 'kiln\[qlora\]'"):
        quantize(torch.randn(64, 64), torch.bfloat16)


def test_a_torchao_made_for_another_torch_is_named_with_both_versions(monkeypatch, tmp_path):
    """torchao 0.18 beside torch 2.6 fails inside its own import with an AttributeError, not an ImportError."""
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text(
        "raise AttributeError(\"module 'torch.utils._pytree' has no attribute 'register_constant'\")\n")
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"torchao .* does not load with torch {re.escape(torch.__version__)} "
                                          r"\(AttributeError: .*register_constant'\); install the torchao release"):
        quantize(torch.randn(64, 64), torch.bfloat16)


def test_quantize_base_needs_a_rank_and_the_native_model():
    from kiln.config import RunConfig

    with pytest.raises(ValueError, match="lora.rank is 0"):
        LoraConfig(quantize_base="nf4")
    with pytest.raises(ValueError, match="model.hf_class=auto it is not supported"):
        RunConfig(model={"hf_class": "auto", "init_from": "x"}, lora={"rank": 4, "quantize_base": "nf4"})
