"""A LoRA run merged: its adapters on the base as stored in model.init_from, every sum in fp32."""

from __future__ import annotations

import torch

from kiln.config import LoraConfig, ModelConfig
from kiln.model.llama import Transformer
from kiln.model.lora import adapter_state_dict, apply_lora, merge_state_dict
from kiln.state.export import export_hf
from kiln.state.lora_base import merged_model


def test_adapters_merge_onto_the_stored_base_in_fp32(tmp_path):
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, tie_embeddings=True)
    torch.manual_seed(0)
    export_hf(Transformer(cfg), cfg, None, tmp_path, dtype="bf16")  # a base stored in bf16
    run_cfg = cfg.model_copy(update={"init_from": str(tmp_path), "hf_model_type": "llama"})
    lora = LoraConfig(rank=4, alpha=8, targets=["q", "v", "down"])
    trained = apply_lora(Transformer(run_cfg), lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    adapters = adapter_state_dict(trained)
    merged = merged_model(run_cfg, lora, adapters)
    from safetensors.torch import load_file

    stored = {k.removeprefix("model."): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    stored["lm_head.weight"] = stored["embed_tokens.weight"]
    want = merge_state_dict({**stored, **adapters}, lora)
    got = merged.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(v.dtype == torch.float32 for v in got.values())
    assert merged.lm_head.weight is merged.embed_tokens.weight  # tied, one tensor
    assert not torch.equal(got["layers.0.self_attn.q_proj.weight"], stored["layers.0.self_attn.q_proj.weight"].float())
