"""The Triton cross-entropy kernel (kiln.model.loss_triton) against PyTorch's (kiln.model.loss): the same summed
loss and logits' gradient in fp32 and bf16, at vocabularies that are no multiple of its block, with ignored rows
and Gemma's soft-cap; and the whole chunked `linear_cross_entropy` through it against F.cross_entropy.

On a GPU it runs natively (marked gpu). Without one, `TRITON_INTERPRET=1 pytest tests/unit/model/test_loss_triton.py`
runs the same kernel on CPU tensors under Triton's interpreter, where triton is installed (hence here, not in
tests/gpu/, which is skipped without CUDA); otherwise (CI's CPU machines) it is skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model import loss as loss_module
from kiln.model import loss_triton
from kiln.model.loss import chunk_loss_and_grad, linear_cross_entropy

CUDA = torch.cuda.is_available()
triton = pytest.importorskip("triton")
# Triton reads TRITON_INTERPRET as it is imported (by torch, as kiln.model is), so it is set on the command line
if not CUDA and not loss_triton.interpreting():
    pytest.skip("no CUDA GPU: run with TRITON_INTERPRET=1 for Triton's interpreter", allow_module_level=True)
pytestmark = [pytest.mark.gpu] if CUDA else []
# one rounding to bf16: half a unit in the last place of its 8 significant bits; Triton's interpreter truncates
# instead (a whole unit)
BF16_RTOL = 2.0**-8 if CUDA else 2.0**-7


@pytest.fixture
def device():
    """'cuda', or 'cpu' under Triton's interpreter."""
    return "cuda" if CUDA else "cpu"


def _case(n, vocab, dtype, device, ignored=(1, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype).to(device)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[list(i for i in ignored if i < n)] = -100
    return logits, targets.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_loss_and_gradient_match_pytorchs(device, dtype, softcap):
    logits, targets = _case(9, 1000, dtype, device)  # 1000: no multiple of the blocks below
    want_loss, want_grad = chunk_loss_and_grad(logits.float(), targets, True, softcap)  # fp32 from the same logits
    for block in (256, None):  # four blocks, the last a partial one; one block wider than the row
        loss, grad = loss_triton.chunk_loss_and_grad(logits, targets, True, softcap, block=block)
        assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
        assert torch.equal(grad[[1, 4]], torch.zeros_like(grad[[1, 4]]))  # ignored rows
        if dtype == torch.float32:
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
        else:  # within one rounding of the exact gradient, as PyTorch's own bf16 gradient is
            assert ((grad.float() - want_grad).abs() <= BF16_RTOL * want_grad.abs() + 1e-7).all()
            torch_grad = chunk_loss_and_grad(logits, targets, True, softcap)[1]
            assert ((torch_grad.float() - want_grad).abs() <= BF16_RTOL * want_grad.abs() + 1e-7).all()
        loss_only, none = loss_triton.chunk_loss_and_grad(logits, targets, False, softcap, block=block)
        assert none is None and torch.equal(loss_only, loss)


def test_in_place_writes_the_gradient_over_the_logits(device):
    logits, targets = _case(5, 300, torch.bfloat16, device)
    want_loss, want_grad = loss_triton.chunk_loss_and_grad(logits, targets, True, block=128)
    loss, grad = loss_triton.chunk_loss_and_grad(logits, targets, True, in_place=True, block=128)
    assert grad.data_ptr() == logits.data_ptr() and torch.equal(grad, want_grad) and torch.equal(loss, want_loss)


def test_rows_all_ignored_and_a_target_outside_the_vocabulary(device):
    logits, targets = _case(3, 100, torch.float32, device)
    loss, grad = loss_triton.chunk_loss_and_grad(logits, torch.full_like(targets, -100), True)
    assert loss.item() == 0.0 and not grad.any()
    targets[0] = 100  # one past the vocabulary: a NaN loss, no read outside the row
    assert loss_triton.chunk_loss_and_grad(logits, targets, False)[0].isnan()


@pytest.mark.parametrize("vocab", [32000, 50257, 128256, 151936, 256000])
def test_the_vocabularies_of_real_models(device, vocab):
    logits, targets = _case(4, vocab, torch.bfloat16, device, ignored=(2,))
    want_loss, want_grad = chunk_loss_and_grad(logits.float(), targets, True)
    loss, grad = loss_triton.chunk_loss_and_grad(logits, targets, True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    assert ((grad.float() - want_grad).abs() <= BF16_RTOL * want_grad.abs() + 1e-7).all()


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_linear_cross_entropy_through_it_matches_f_cross_entropy(device, monkeypatch, softcap):
    kernel = loss_triton.TritonChunkKernel(chunk_loss_and_grad)
    monkeypatch.setattr(loss_module.ChunkKernel, "fn", kernel)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 products, whatever ran before
    g = torch.Generator().manual_seed(1)
    h = torch.randn(70, 32, generator=g).to(device).requires_grad_()
    w = (torch.randn(1000, 32, generator=g) * 0.3).to(device).requires_grad_()
    targets = torch.randint(0, 1000, (70,), generator=g).to(device)
    targets[::9] = -100
    loss = linear_cross_entropy(h, w, targets, rows=32, softcap=softcap)  # three chunks, the last of 6 rows
    loss.backward()
    h0, w0 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = h0 @ w0.t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    want = F.cross_entropy(logits, targets, ignore_index=-100)
    want.backward()
    assert kernel.failed is None and kernel.built == {(torch.float32, True, softcap is None)}  # Triton's ran
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(h.grad, h0.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w0.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_frozen_weight_through_it_gives_the_same_loss_and_hidden_states_gradient(device, monkeypatch, softcap):
    """LoRA's frozen lm_head: no weight gradient made (kiln.model.loss), the rest bit for bit as with a trained one."""
    kernel = loss_triton.TritonChunkKernel(chunk_loss_and_grad)
    monkeypatch.setattr(loss_module.ChunkKernel, "fn", kernel)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(70, 32, generator=g).to(device).requires_grad_()
    w = (torch.randn(1000, 32, generator=g) * 0.3).to(device)
    targets = torch.randint(0, 1000, (70,), generator=g).to(device)
    targets[::9] = -100
    out = []
    for trained in (True, False):
        w.requires_grad_(trained)
        with torch.autocast(device, torch.bfloat16, enabled=CUDA):
            loss = linear_cross_entropy(h, w, targets, rows=32, softcap=softcap)
        out.append((loss.detach(), torch.autograd.grad(loss, h)[0]))
    assert kernel.failed is None and len(kernel.built) == 1  # Triton's ran
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


@pytest.mark.skipif(not CUDA, reason="bf16 autocast of the matrix products: on a GPU")
def test_linear_cross_entropy_under_autocast_matches_pytorchs_kernel(monkeypatch):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4096, 256, generator=g).cuda().requires_grad_()
    w = (torch.randn(32000, 256, generator=g) * 0.1).cuda().requires_grad_()
    targets = torch.randint(0, 32000, (4096,), generator=g).cuda()
    targets[::7] = -100
    out = {}
    kernel = loss_triton.TritonChunkKernel(chunk_loss_and_grad)
    for name, fn in (("torch", chunk_loss_and_grad), ("triton", kernel)):
        monkeypatch.setattr(loss_module.ChunkKernel, "fn", fn)
        h.grad = w.grad = None
        with torch.autocast("cuda", torch.bfloat16):
            loss = linear_cross_entropy(h, w, targets, rows=1024)
        loss.backward()
        out[name] = loss.detach(), h.grad.clone(), w.grad.clone()
    assert kernel.failed is None and kernel.built == {(torch.bfloat16, True, True)}
    for a, b in zip(out["triton"], out["torch"]):  # bf16 gradients of the logits, one rounding apart at most
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_fp16_logits_with_a_row_stride_of_their_own_and_int32_targets(device):
    wide, targets = _case(6, 700, torch.float16, device)
    logits = wide[:, :500]  # rows 700 apart
    targets = torch.where(targets < 500, targets, 3).int()
    want_loss, want_grad = chunk_loss_and_grad(logits.float(), targets.long(), True)
    loss, grad = loss_triton.chunk_loss_and_grad(logits, targets, True, block=128)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    assert grad.dtype == torch.float16
    assert ((grad.float() - want_grad).abs() <= 2.0**-10 * want_grad.abs() + 1e-7).all()  # fp16: 11 bits
