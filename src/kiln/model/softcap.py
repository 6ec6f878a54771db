"""Soft-capping: scores squashed into (-cap, cap) by cap * tanh(score / cap) (Gemma 2's attention and the
final logits of Gemma 2 and 3).

SDPA has no hook for it, so capped attention runs as flex attention with a score modifier on CUDA (the
block mask of kiln.model.masks, built for every layer of a capped model) and as eager attention on the CPU
(scores, cap, mask, softmax in fp32, values): the same order of operations as transformers' eager Gemma 2.
"""

from __future__ import annotations

import functools

import torch


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


@functools.cache
def score_mod(cap: float):
    """Flex attention's score modifier for `cap`: one function object per cap, so a compiled flex kernel is
    reused by every layer instead of recompiled for each."""

    def capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return capped


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float | None, cap: float) -> torch.Tensor:
    """q (B, H, T, hd), k and v (B, KV, T, hd), mask a boolean (B|1, 1, T, T) (None: causal) -> (B, H, T, hd)."""
    B, H, T, hd = q.shape
    if k.shape[1] != H:  # grouped-query heads: each key/value head serves H / KV query heads
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    scores = softcap((q @ k.transpose(-1, -2)) * (hd ** -0.5 if scale is None else scale), cap)  # (B, H, T, T)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype) @ v
