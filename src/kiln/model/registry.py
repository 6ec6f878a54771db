"""Named model sizes (their data lives in kiln.sizes, which the config reads) and the closed forms
for parameter count and training FLOPs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.sizes import SIZES

if TYPE_CHECKING:
    from kiln.config import ModelConfig

__all__ = ["SIZES", "active_param_count", "flops_per_token", "param_count", "sequence_flops"]


def param_count(cfg: ModelConfig, vocab_size: int | None = None, active: bool = False) -> int:
    """Exact number of parameters of `Transformer(cfg)` (tied embeddings counted once). `active`: a mixture of
    experts counts the top_k experts a token goes through, not all of them (the router and shared expert too)."""
    v = vocab_size or cfg.vocab_size
    if v is None:
        raise ValueError("param_count needs a vocabulary size")
    if cfg.layer_pattern is not None:
        return _hybrid_param_count(cfg, v)
    d, h, kv, q = cfg.d_model, cfg.mlp_hidden, cfg.kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim
    attn = 2 * d * q + 2 * d * kv
    attn += {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + d}[cfg.attention_bias]
    gated = cfg.mlp != "relu2"  # swiglu and geglu: gate, up and down
    mlp = (3 if gated else 2) * d * h + ((2 if gated else 1) * h + d if cfg.mlp_bias else 0)
    norm = 2 * d if cfg.norm == "layernorm1p" else d  # LayerNorm1p has a bias
    attn += 2 * cfg.head_dim * norm // d if cfg.qk_norm else 0  # q/k norms of the same kind, over a head
    per_layer = attn + (4 if cfg.sandwich_norm else 2) * norm  # sandwich: after attention and the MLP too
    embed = v * d * (1 if cfg.tie_embeddings else 2)
    m = cfg.moe
    dense = cfg.n_layers if m is None else len({i for i in m.dense_layers if i < cfg.n_layers})
    total = embed + cfg.n_layers * per_layer + dense * mlp + norm  # final norm
    if m is not None:
        experts = m.top_k if active else m.n_experts
        shared = 3 * d * m.shared_expert_hidden + d if m.shared_expert_hidden else 0  # its MLP and its gate
        total += (cfg.n_layers - dense) * (d * m.n_experts + experts * 3 * d * m.expert_hidden + shared)
    return total


def active_param_count(cfg: ModelConfig, vocab_size: int | None = None) -> int:
    """Parameters one token goes through: all of them, or with a mixture of experts its top_k experts alone."""
    return param_count(cfg, vocab_size, active=True)


def _hybrid_param_count(cfg: ModelConfig, v: int) -> int:
    """Parameters of a hybrid model (model.layer_pattern; the first n_layers of it): each layer a norm and its
    mixer: Mamba-2 (projections, convolution, dt_bias, A_log, D, gated norm), attention or the MLP."""
    d, q, kv, h = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.mlp_hidden
    m, heads = cfg.mamba, cfg.mamba_heads
    inner = heads * m.head_dim
    conv = inner + 2 * m.groups * m.state
    mamba = d * (inner + conv + heads) + inner * d + (inner + conv + heads + d if m.proj_bias else 0)
    mamba += conv * m.conv_kernel + (conv if m.conv_bias else 0) + 3 * heads + inner
    attn = 2 * d * q + 2 * d * kv + {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + d}[cfg.attention_bias]
    gated = cfg.mlp == "swiglu"
    mlp = (3 if gated else 2) * d * h + ((2 if gated else 1) * h + d if cfg.mlp_bias else 0)
    per_kind = {"M": mamba, "*": attn, "-": mlp}
    layers = sum(per_kind[k] + d for k in cfg.layer_pattern[:cfg.n_layers])
    return v * d * (1 if cfg.tie_embeddings else 2) + layers + d


def sequence_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token beyond 6 per parameter: what mixes positions.

    Attention: its score and value products, 12*q*T per layer (q = n_heads * head_dim; forward and backward)
    for a causal model of context T, as in the PaLM paper (the masked half counted, as there). Mamba-2: its
    scan counted as the chunked form computes it, per token of a chunk of L positions (forward multiply-adds,
    times 6 for training's 2 FLOPs each, forward and backward): C B^T within the chunk (L*G*N), those scores
    times x (L*H*P), the chunk's state and the reading of it (2*H*P*N), and the state passing between the T/L
    chunks (T/L^2 * H*P*N); the convolution's products are its parameters'. A layer with a sliding window
    w < T counts 2w - w^2/T for T: its keys per query, doubled as the causal count doubles T/2 to T."""
    pattern = cfg.layer_pattern or "*" * cfg.n_layers
    w, full = cfg.sliding_window, cfg.full_attention_layers or ()
    local = seq_len if w is None or w >= seq_len else 2 * w - w * w / seq_len
    attn = 12.0 * cfg.n_heads * cfg.head_dim
    m, H = cfg.mamba, cfg.mamba_heads
    L = min(m.chunk, seq_len)
    HPN = H * m.head_dim * m.state
    scan = 6.0 * (L * m.groups * m.state + L * H * m.head_dim + 2 * HPN + seq_len / L**2 * HPN)
    return sum(attn * (seq_len if i in full else local) if k == "*" else scan if k == "M" else 0.0
               for i, k in enumerate(pattern[:cfg.n_layers]))


def flops_per_token(cfg: ModelConfig, seq_len: int, vocab_size: int | None = None) -> float:
    """Training FLOPs per token, 6*N + sequence_flops (12*L*d*T for a Llama), with N the parameters that do
    matrix products.

    N leaves out the input embedding table (a lookup), but keeps the output projection; with tied
    embeddings the shared matrix counts once. A mixture of experts counts its active parameters (the
    router, the top_k experts, a shared expert): MFU is of the products each token makes. The second
    term is attention's score and value products (forward and backward) for a causal model of context
    T, as in the PaLM paper, and a hybrid model's Mamba-2 scans (see sequence_flops).
    """
    v = vocab_size or cfg.vocab_size
    n = active_param_count(cfg, v) - (0 if cfg.tie_embeddings else v * cfg.d_model)
    return 6.0 * n + sequence_flops(cfg, seq_len)
