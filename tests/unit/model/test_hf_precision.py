"""kiln.model.hf_precision: under bf16 autocast a transformers model carries its residual stream in bf16 and
rotates in fp32, as the native model does; outside autocast nothing changes."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.hf_auto import HFCausalLM

transformers = pytest.importorskip("transformers")


def test_residual_stream_in_bf16_and_rotary_tables_in_fp32_under_autocast():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = HFCausalLM(transformers.LlamaForCausalLM(config), ModelConfig(vocab_size=64, max_seq_len=32))
    seen = []
    model.layers[1].register_forward_pre_hook(
        lambda m, args, kw: seen.append((args[0].dtype, kw["position_embeddings"][0].dtype)), with_kwargs=True)
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    fp32 = model(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(x, y)
    assert seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay fp32
    torch.testing.assert_close(bf16.float(), fp32, atol=0.05, rtol=0.02)
