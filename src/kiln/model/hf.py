"""Mapping between Kiln's model and Hugging Face `LlamaForCausalLM`: config and state dict, both ways.

Kiln's modules carry HF's names without the `model.` prefix and use the same rotary layout, so the
weights map one to one with no permutation. Export and import build on these functions; only
`hf_config` imports transformers (an optional extra).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.config import ModelConfig
from kiln.errors import StateError

_TOP_LEVEL = ("lm_head.",)  # keys HF keeps outside its `model.` submodule


def to_hf_config_dict(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The `config.json` fields of the equivalent `LlamaForCausalLM` (extra: e.g. bos/eos ids)."""
    if cfg.vocab_size is None:
        raise ValueError("ModelConfig.vocab_size must be set to describe the model to Hugging Face")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, **extra,
    }


def hf_config(cfg: ModelConfig, **extra: Any):
    """A `transformers.LlamaConfig` for the same shape (needs the `hf` extra)."""
    from transformers import LlamaConfig

    fields = to_hf_config_dict(cfg, **extra)
    for key in ("architectures", "model_type", "rope_scaling"):
        fields.pop(key)
    return LlamaConfig(**fields)


def from_hf_config_dict(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Llama `config.json` dict; raises StateError for what Kiln cannot represent."""
    if hf.get("model_type", "llama") != "llama":
        raise StateError(f"model_type '{hf.get('model_type')}' is not a Llama model; Kiln imports Llama checkpoints")
    problems = [f"{k}={hf[k]}" for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(f"rope_type={rope.get('rope_type', rope.get('type'))}")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        problems.append(f"head_dim={hf['head_dim']} (Kiln needs hidden_size / num_attention_heads = {d // heads})")
    if problems:
        raise StateError(f"this Llama config uses features Kiln's model does not have: {', '.join(problems)}")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=float(theta),
        norm_eps=hf.get("rms_norm_eps", 1e-5), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02),
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Kiln state dict -> `LlamaForCausalLM` state dict (tied: lm_head.weight left out, as HF saves it)."""
    out = {}
    for key, value in state.items():
        if key == "lm_head.weight" and tie_embeddings:
            continue
        out[key if key.startswith(_TOP_LEVEL) else f"model.{key}"] = value
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` state dict -> Kiln state dict (rotary caches dropped; tied head filled in)."""
    out = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        out[key.removeprefix("model.")] = value
    if tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    elif "lm_head.weight" not in out:
        raise StateError("the checkpoint has no lm_head.weight but its config says the embeddings are not tied")
    return out
