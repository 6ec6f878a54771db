"""Soft-capped attention on the CPU (eager) against the same attention written out, and the cap's neutral limit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model.masks import attend, doc_mask
from kiln.model.softcap import eager_attention, softcap


def _qkv(B=2, H=4, KV=2, T=12, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, hd, generator=g, dtype=torch.float64) for n in (H, KV, KV)]


def test_capped_attention_is_the_written_out_formula():
    q, k, v = _qkv()
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    mask = doc_mask(doc_ids, torch.device("cpu"), window=4)  # (2, 1, 12, 12): documents and a window
    got = attend(q, k, v, mask, scale=0.3, cap=1.5)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # each kv head serves two query heads
    scores = 1.5 * torch.tanh(torch.einsum("bhqd,bhkd->bhqk", q, kk) * 0.3 / 1.5)
    want = torch.einsum("bhqk,bhkd->bhqd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got - attend(q, k, v, mask, scale=0.3)).abs().max() > 1e-2  # the cap bites at these scores


@pytest.mark.parametrize("window", [None, 5])
def test_a_cap_far_above_the_scores_is_plain_attention(window):
    q, k, v = _qkv(seed=1)
    mask = doc_mask(None, torch.device("cpu"), window=window, T=12, always=True)
    assert mask is not None and mask.shape == (1, 1, 12, 12)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(eager_attention(q, k, v, mask, None, cap=1e7), plain, rtol=1e-9, atol=1e-9)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(eager_attention(q, k, v, None, None, cap=1e7), causal, rtol=1e-9, atol=1e-9)


def test_softcap_bounds_and_keeps_small_values():
    x = torch.tensor([-1e4, -0.01, 0.0, 0.01, 1e4], dtype=torch.float64)
    y = softcap(x, 30.0)
    assert y.abs().max() <= 30.0 and torch.allclose(y[1:4], x[1:4], rtol=1e-6)
