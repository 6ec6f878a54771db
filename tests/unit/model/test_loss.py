"""The chunked linear cross-entropy equals the plain one, in value and gradients, and holds less memory."""

import pytest
import torch
import torch.nn.functional as F

from kiln.model.loss import chunk_rows, linear_cross_entropy


def _reference(h, w, t):
    logits = h @ w.t()
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), t, ignore_index=-100)


@pytest.mark.parametrize("rows", [None, 256, 300])  # one chunk, several, a ragged last chunk
def test_matches_cross_entropy_and_grads(rows):
    g = torch.Generator().manual_seed(0)
    n, d, v = 1000, 32, 517
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100  # some positions carry no loss
    loss = linear_cross_entropy(h, w, t, rows=rows)
    gh, gw = torch.autograd.grad(loss * 3.0, (h, w))
    ref = _reference(h, w, t)
    rh, rw = torch.autograd.grad(ref * 3.0, (h, w))
    assert torch.allclose(loss, ref, rtol=1e-6)
    assert torch.allclose(gh, rh, rtol=1e-6, atol=1e-9)
    assert torch.allclose(gw, rw, rtol=1e-6, atol=1e-9)


def test_batched_shapes_and_no_grad():
    h = torch.randn(2, 5, 8)
    w = torch.randn(11, 8)
    t = torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t)
    assert loss.requires_grad is False
    assert torch.allclose(loss, _reference(h.flatten(0, 1), w, t.flatten()), rtol=1e-5)


def test_bf16_autocast_close_to_fp32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(512, 64, generator=g, requires_grad=True)
    w = (torch.randn(1000, 64, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, 1000, (512,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t, rows=256)
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    ref = _reference(h.detach(), w.detach(), t)
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-2


def test_all_ignored_is_nan_like_torch():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    t = torch.full((4,), -100)
    assert torch.isnan(linear_cross_entropy(h, w, t)) and torch.isnan(_reference(h, w, t))


def test_chunk_rows_bounds_memory():
    assert chunk_rows(32768, 32000) == 8192
    assert chunk_rows(32768, 128256) % 256 == 0 and chunk_rows(32768, 128256) * 128256 <= 2**28
    assert chunk_rows(100, 32000) == 100


@pytest.mark.parametrize("rows", [None, 300])
def test_softcapped_logits_match_cross_entropy_and_grads(rows):
    """Gemma's soft-cap inside the chunks: the loss of cap * tanh(logits / cap), and gradients through the cap."""
    g = torch.Generator().manual_seed(2)
    n, d, v, cap = 700, 16, 97, 2.0
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    loss = linear_cross_entropy(h, w, t, rows=rows, softcap=cap)
    gh, gw = torch.autograd.grad(loss, (h, w))
    ref = F.cross_entropy(torch.tanh((h @ w.t()) / cap) * cap, t, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(loss, ref, rtol=1e-9) and not torch.allclose(loss, _reference(h, w, t), rtol=1e-2)
    assert torch.allclose(gh, rh, rtol=1e-7, atol=1e-12) and torch.allclose(gw, rw, rtol=1e-7, atol=1e-12)
