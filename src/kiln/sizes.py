"""Named model sizes: plain data, so the config can check `model.size` without importing the model.

Shapes follow well-known Llama-family models so that exports line up with their layouts. The
closed forms for parameter count and FLOPs are in `kiln.model.registry`.
"""

from __future__ import annotations

from typing import Any

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
