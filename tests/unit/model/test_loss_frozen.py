"""A frozen output projection (LoRA and QLoRA, whose base includes lm_head) gets no gradient made in the chunked
loss: no (V, d) fp32 sum, no product for it; the loss and the hidden states' gradient are bit for bit what the
loss made before it skipped them. Frozen hidden states (only the head trained) likewise get no (n, d) gradient."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kiln.model import loss, loss_weight_grad
from kiln.model.loss import ChunkKernel, chunk_loss_and_grad, linear_cross_entropy


class _Before(torch.autograd.Function):
    """kiln.model.loss's Function as it was before it skipped a frozen input's gradient: both made whenever either
    was wanted."""

    @staticmethod
    def forward(ctx, h, weight, targets, dtype, rows, softcap):
        n = h.shape[0]
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)
        total = torch.zeros((), dtype=acc)
        grad_h = torch.empty_like(h)
        grad_w = loss_weight_grad.zeros(weight.shape, acc, weight.dtype, weight.device)
        for s in range(0, n, rows):
            hc = h[s:s + rows].to(dtype)
            part, g = ChunkKernel.fn(hc @ w.t(), targets[s:s + rows], True, softcap)
            total += part
            grad_h[s:s + rows] = g @ w
            for v in range(0, w.shape[0], loss.VOCAB_SLICE):
                loss_weight_grad.add_rows(grad_w, v, g[:, v:v + loss.VOCAB_SLICE].t() @ hc)
            del g
        count = (targets != -100).sum().to(acc)
        ctx.save_for_backward(grad_h, count, *grad_w)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, count, *grad_w = ctx.saved_tensors
        scale = grad_out.to(count.dtype) / count
        gh = (grad_h * scale).to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = loss_weight_grad.scaled(grad_w, scale, ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def _before(h, w, t, rows, softcap):
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else h.dtype
    return _Before.apply(h, w, t, dtype, rows, softcap)


def _in_place_kernel(logits, targets, want_grad, softcap=None):
    """As the Triton kernel (kiln.parallel.loss_kernel) does: the logits' gradient written over the logits."""
    part, g = chunk_loss_and_grad(logits, targets, want_grad, softcap)
    if g is not None:
        logits.copy_(g)
        g = logits
    return part, g


def _inputs(v, d, n, h_dtype, w_dtype, frozen):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(h_dtype).requires_grad_(frozen != "h")
    w = (torch.randn(v, d, generator=g) * 0.1).to(w_dtype).requires_grad_(frozen != "w")
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return h, w, t


CASES = {  # (hidden states' dtype, weight's dtype, bf16 autocast, softcap, kernel)
    "fp32": (torch.float32, torch.float32, False, None, None),
    "fp32-weight-bf16-autocast": (torch.float32, torch.float32, True, None, None),
    "bf16-weight-bf16-autocast": (torch.bfloat16, torch.bfloat16, True, None, None),  # QLoRA's bf16 lm_head
    "bf16": (torch.bfloat16, torch.bfloat16, False, None, None),
    "softcap": (torch.float32, torch.float32, False, 2.0, None),
    "softcap-bf16-autocast": (torch.bfloat16, torch.bfloat16, True, 30.0, None),
    "in-place-kernel-bf16-autocast": (torch.bfloat16, torch.bfloat16, True, None, _in_place_kernel),
    "in-place-kernel-softcap": (torch.float32, torch.float32, False, 2.0, _in_place_kernel),
}


@pytest.mark.parametrize("frozen", ["w", "h"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_unfrozen_gradient_and_the_loss_are_bit_identical_to_before(monkeypatch, case, frozen):
    h_dtype, w_dtype, autocast, softcap, kernel = CASES[case]
    if kernel is not None:
        monkeypatch.setattr(ChunkKernel, "fn", kernel)
    monkeypatch.setattr(loss, "VOCAB_SLICE", 64)  # several slices of the vocabulary, as at a real one
    h, w, t = _inputs(517, 24, 200, h_dtype, w_dtype, frozen)
    wants = w if frozen == "h" else h
    out = []
    for fn in (linear_cross_entropy, _before):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = fn(h, w, t, rows=64, softcap=softcap)
        (grad,) = torch.autograd.grad(value * 3.0, (wants,))
        out.append((value, grad))
    for a, b in zip(*out, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _NewStorages(TorchDispatchMode):
    """(elements, dtype) of every storage an op makes while it is on, and the matrix products run."""

    def __init__(self):
        super().__init__()
        self.seen, self.made, self.products = set(), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.products += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(x.untyped_storage().data_ptr())
                self.made.append((x.untyped_storage().nbytes() // x.element_size(), x.dtype))
        return out


@pytest.mark.parametrize(("w_dtype", "autocast"), [(torch.bfloat16, True), (torch.float32, True),
                                                   (torch.float32, False)], ids=["bf16", "fp32-autocast", "fp32"])
def test_a_frozen_weight_gets_no_vocabulary_sized_sum_and_no_product_for_it(w_dtype, autocast):
    """The fp32 sum of the projection's gradient was made whenever the hidden states wanted theirs: 2 GiB at a 128K
    vocabulary and d = 4096 (3.9 at 256K), and a third of the loss's matrix products, for a weight LoRA froze."""
    v, d, n, rows = 3001, 128, 256, 32  # a chunk's logits (rows * V) well under half the weight's elements
    h, w, t = _inputs(v, d, n, w_dtype, w_dtype, frozen="w")
    seen = _NewStorages()
    seen.seen |= {x.untyped_storage().data_ptr() for x in (h, w)}  # views of the inputs (w.t()) are no new storage
    with seen, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = linear_cross_entropy(h, w, t, rows=rows)
    # the sum's first block alone is ceil(V / 2) rows (kiln.model.loss_weight_grad); fp32 weights: the whole (V, d)
    assert not [m for m in seen.made if m[1] == torch.float32 and m[0] >= v * d // 2]
    assert seen.products == 2 * (n // rows)  # each chunk's logits and the hidden states' gradient, nothing more
    assert [tuple(x.shape) for x in out.grad_fn.saved_tensors] == [(n, d), ()]  # the hidden states' gradient, count
    out.backward()
    assert w.grad is None and h.grad is not None


def test_a_frozen_weight_allows_a_second_backward():
    """Nothing is spent by the backward pass when no weight gradient is made there: retain_graph works."""
    h, w, t = _inputs(50, 8, 20, torch.float32, torch.float32, frozen="w")
    out = linear_cross_entropy(h, w, t)
    out.backward(retain_graph=True)
    first = h.grad.clone()
    out.backward()
    assert torch.equal(h.grad, 2 * first)
