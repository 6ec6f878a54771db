"""Named model sizes (their data lives in kiln.sizes, which the config reads) and the closed forms
for parameter count and training FLOPs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.sizes import SIZES

if TYPE_CHECKING:
    from kiln.config import ModelConfig

__all__ = ["SIZES", "flops_per_token", "param_count"]


def param_count(cfg: ModelConfig, vocab_size: int | None = None) -> int:
    """Exact number of parameters of `Transformer(cfg)` (tied embeddings counted once)."""
    v = vocab_size or cfg.vocab_size
    if v is None:
        raise ValueError("param_count needs a vocabulary size")
    d, h, kv, q = cfg.d_model, cfg.mlp_hidden, cfg.kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim
    attn = 2 * d * q + 2 * d * kv
    attn += {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + d}[cfg.attention_bias]
    gated = cfg.mlp == "swiglu"
    mlp = (3 if gated else 2) * d * h + ((2 if gated else 1) * h + d if cfg.mlp_bias else 0)
    norm = 2 * d if cfg.norm == "layernorm1p" else d  # LayerNorm1p has a bias
    per_layer = attn + mlp + 2 * norm
    embed = v * d * (1 if cfg.tie_embeddings else 2)
    return embed + cfg.n_layers * per_layer + norm  # final norm


def flops_per_token(cfg: ModelConfig, seq_len: int, vocab_size: int | None = None) -> float:
    """Training FLOPs per token, 6*N + 12*L*d*T, with N the parameters that do matrix products.

    N leaves out the input embedding table (a lookup), but keeps the output projection; with tied
    embeddings the shared matrix counts once. The second term is attention's score and value
    products (forward and backward) for a causal model of context T, as in the PaLM paper.
    """
    v = vocab_size or cfg.vocab_size
    n = param_count(cfg, v) - (0 if cfg.tie_embeddings else v * cfg.d_model)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len
