"""Small Hugging Face configs of each architecture Kiln imports, built locally with random weights."""

from __future__ import annotations

import pytest
import torch

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)

ARCHS = {
    "llama": dict(model_type="llama", **SMALL),
    "llama3.1": dict(model_type="llama", **SMALL, tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=16)),
    "llama-bias": dict(model_type="llama", **SMALL, attention_bias=True, mlp_bias=True,
                       rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    "mistral": dict(model_type="mistral", **{**SMALL, "num_attention_heads": 2, "num_key_value_heads": 1},
                    head_dim=48, sliding_window=8),
    "qwen2": dict(model_type="qwen2", **SMALL, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "nemotron": dict(model_type="nemotron", **SMALL, attention_bias=True,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    # head_dim unlike hidden_size / heads (64 / 4), as Qwen3's is
    "qwen3": dict(model_type="qwen3", **SMALL, head_dim=32, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3-bias": dict(model_type="qwen3", **SMALL, head_dim=32, attention_bias=True),  # on all four projections
    "phi3": dict(model_type="phi3", **SMALL, sliding_window=8, pad_token_id=0,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    # 3 layers: local, global, local, with windows shorter than the rows and caps the scores and logits reach
    "gemma2": dict(model_type="gemma2", **{**SMALL, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=12, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3": dict(model_type="gemma3_text", **{**SMALL, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=12,
                   final_logit_softcapping=3.0,
                   rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
                                    "sliding_attention": dict(rope_type="default", rope_theta=100.0)}),
}


def build_hf_model(arch: str, seed: int = 0):
    """A transformers causal LM of `arch` in fp32 with every parameter random (norms and biases included)."""
    transformers = pytest.importorskip("transformers")
    fields = dict(ARCHS[arch])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def hf_model():
    """build_hf_model(arch, seed=0): see ARCHS for the architectures."""
    return build_hf_model
