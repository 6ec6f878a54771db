"""The layers Gemma 2 and 3 add to the Llama-family decoder (kiln.model.llama builds them when the config
asks: norm 'rmsnorm1p', mlp 'geglu', sandwich_norm).

Module names are transformers' Gemma2/Gemma3 ones, so weights map one to one: a block holds
input_layernorm, self_attn, post_attention_layernorm (after attention, before the residual add),
pre_feedforward_layernorm, mlp and post_feedforward_layernorm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig


class RMSNorm1P(nn.Module):
    """RMSNorm whose scale is stored minus one (weight 0 is the identity), scaled in fp32 before the cast back
    to the input dtype (Llama's RMSNorm casts first, then scales)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): SwiGLU's layers with GELU's tanh approximation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, b = cfg.d_model, cfg.mlp_hidden, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, h, bias=b)
        self.up_proj = nn.Linear(d, h, bias=b)
        self.down_proj = nn.Linear(h, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class SandwichBlock(nn.Module):
    """A decoder block with norms on both sides of attention and of the MLP:
    x + post_attn(attn(input(x))), then x + post_ff(mlp(pre_ff(x)))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def embed_scale(d_model: int, dtype: torch.dtype) -> float:
    """sqrt(d_model) rounded to `dtype`, as Gemma scales its embeddings (sqrt(3072) is 55.5 in bf16)."""
    return float(torch.tensor(d_model ** 0.5, dtype=dtype))
