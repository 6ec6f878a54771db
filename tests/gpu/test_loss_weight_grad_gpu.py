"""On a GPU the chunked loss's backward holds the output layer's gradient once: the bf16 gradient autograd keeps is
written over the fp32 sum's memory (kiln.model.loss_weight_grad), bit for bit the sum's scaled values rounded."""

from __future__ import annotations

import pytest
import torch

from kiln.model.loss import linear_cross_entropy

pytestmark = pytest.mark.gpu

V, D, N = 131072, 2048, 4096  # a 1 GiB fp32 sum, 0.5 GiB of bf16 gradient


def _inputs(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    return h, w, t


def test_the_backward_adds_no_vocabulary_sized_buffer_and_grad_is_the_sums_memory():
    h, w, t = _inputs(torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t)
    sums = [x for x in out.grad_fn.saved_tensors if x.dtype == torch.float32 and x.dim() == 2]
    assert sum(x.numel() for x in sums) == V * D
    first = sums[0].data_ptr()
    del sums  # the test's own references would keep them past the backward
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # the former backward made a (V, d) bf16 buffer and an fp32 slice of 8192 rows: 512 + 64 MiB
    assert extra < 2 * N * D * 2 + (8 << 20), f"{extra / 2**20:.0f} MiB more at the loss's backward"
    assert w.grad.data_ptr() == first and w.grad.is_contiguous() and w.grad.dtype == torch.bfloat16
    # the sum's second block is gone once autograd has the gradient: what stays is a gradient's worth
    assert torch.cuda.memory_allocated() - before < -(V * D * 2) + 2 * N * D * 2 + (8 << 20)


def test_the_bf16_gradient_is_the_fp32_ones_rounded():
    """An fp32 weight of the same bf16 values makes the same products and sum, scaled in place and returned
    whole: the bf16 weight's gradient, written over its sum's bytes, must be exactly that rounded."""
    grads = {}
    for dtype in (torch.bfloat16, torch.float32):
        h, w, t = _inputs(dtype)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = linear_cross_entropy(h, w, t)
        out.backward()
        grads[dtype] = (out.detach(), h.grad, w.grad)
    (l16, h16, w16), (l32, h32, w32) = grads[torch.bfloat16], grads[torch.float32]
    assert torch.equal(l16, l32) and torch.equal(h16, h32)
    assert torch.equal(w16, w32.to(torch.bfloat16))
