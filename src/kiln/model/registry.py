"""Named model sizes and the closed forms for parameter count and training FLOPs.

Shapes follow well-known Llama-family models so that exports line up with their layouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.config import ModelConfig

SIZES: dict[str, dict[str, Any]] = {
    # a few hundred thousand parameters: unit tests and CI
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=192, max_seq_len=512),
    # GPT-2 small width and depth, Llama blocks
    "124m": dict(d_model=768, n_layers=12, n_heads=12, ffn_hidden=2048, vocab_size=32000, tie_embeddings=True),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=2816, vocab_size=32000, tie_embeddings=True),
    # TinyLlama-1.1B shape
    "1b": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632, vocab_size=32000,
               tie_embeddings=False),
    # Llama-3.2-3B shape
    "3b": dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256,
               tie_embeddings=True, rope_theta=500000.0, max_seq_len=8192),
    # Llama-3-8B shape
    "8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
               tie_embeddings=False, rope_theta=500000.0, max_seq_len=8192),
}


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
