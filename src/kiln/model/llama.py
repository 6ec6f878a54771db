"""A Llama-family decoder as a pure nn.Module: no distribution, precision or checkpoint logic.

Module names follow Hugging Face's `LlamaForCausalLM` (without its `model.` prefix), and rotary
embeddings use the same half-rotation layout, so weights map one to one in both directions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig
from kiln.model.loss import linear_cross_entropy
from kiln.model.masks import attend, doc_mask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability, return in the input dtype (as HF Llama does)
        return (self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (T, head_dim) in the half-rotation layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, hd); cos, sin: (T, hd). Rotates in fp32, returns x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        d = cfg.d_model
        self.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)  # (B, T, H, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)  # (B, T, KV, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        # rotate in the (B, T, H, hd) layout the projections write: contiguous, so the fused
        # elementwise kernels (and their backward) read and write memory in order
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, hd)
        y = attend(q, k, v, mask)  # (B, H, T, hd); mask: see kiln.model.masks
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.mlp_hidden
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only language model. `forward(tokens)` gives logits; with `targets`, the mean loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building the model")
        rng = torch.random.get_rng_state()  # so that eager and meta-then-init_weights agree
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, self.embed_tokens.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.embed_tokens.weight.device.type != "meta":
            torch.random.set_rng_state(rng)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2/Llama practice: N(0, std) everywhere, residual output projections scaled by
        1/sqrt(2 * n_layers); norms at one. Deterministic under torch.manual_seed."""
        std = self.cfg.init_std
        if self.cfg.tie_embeddings:  # re-tie: to_empty() after meta construction unties them
            self.lm_head.weight = self.embed_tokens.weight
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in self.layers:
            for lin in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj,
                        block.mlp.gate_proj, block.mlp.up_proj):
                nn.init.normal_(lin.weight, std=std)
            for lin in (block.self_attn.o_proj, block.mlp.down_proj):
                nn.init.normal_(lin.weight, std=std / math.sqrt(2 * self.cfg.n_layers))
            block.input_layernorm.reset_parameters()
            block.post_attention_layernorm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _rope(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if T > self.rope_cos.shape[0]:  # longer than max_seq_len: extend on the fly (generation only)
            return rotary_tables(self.cfg.head_dim, T, self.cfg.rope_theta, self.rope_cos.device)
        return self.rope_cos[:T], self.rope_sin[:T]

    def hidden(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> final normalised hidden states (B, T, d).

        doc_ids (B, T), optional: the document of each position within its row; attention then
        stays inside each document (block-diagonal causal)."""
        cos, sin = self._rope(tokens.shape[1])
        x = self.embed_tokens(tokens)  # (B, T, d)
        if torch.is_autocast_enabled(x.device.type):
            # carry the residual stream in the autocast dtype (bf16), not fp32: half the memory
            # traffic of every norm, residual add and saved activation; the weights stay fp32
            x = x.to(torch.get_autocast_dtype(x.device.type))
        mask = doc_mask(doc_ids, x.device)  # built once, shared by every layer
        for block in self.layers:
            x = block(x, cos, sin, mask)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden(tokens, doc_ids)
        if targets is None:
            return self.lm_head(h)  # (B, T, V)
        # chunked: never holds the whole batch's logits; ignore_index=-100 marks positions with no loss
        return linear_cross_entropy(h, self.lm_head.weight, targets)
