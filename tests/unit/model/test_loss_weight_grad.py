"""The chunked loss hands back the output projection's gradient in the memory of its fp32 sum: bit for bit what a
separate buffer held, with no second (V, d) buffer at the loss's backward, and a `.grad` that optimizers, tied
embeddings and the offload's hook take as any other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kiln.model import loss, loss_weight_grad
from kiln.model.loss import ChunkKernel, linear_cross_entropy


class _Before(torch.autograd.Function):
    """kiln.model.loss's Function as it was before the gradient was made in the sum's memory: a (V, d) buffer of
    the weight's dtype beside the fp32 sum, filled a slice at a time."""

    @staticmethod
    def forward(ctx, h, weight, targets, dtype, rows):
        n = h.shape[0]
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)
        total = torch.zeros((), dtype=acc)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=acc)
        for s in range(0, n, rows):
            hc = h[s:s + rows].to(dtype)
            part, g = ChunkKernel.fn(hc @ w.t(), targets[s:s + rows], True, None)
            total += part
            grad_h[s:s + rows] = g @ w
            for v in range(0, w.shape[0], loss.VOCAB_SLICE):
                grad_w[v:v + loss.VOCAB_SLICE] += g[:, v:v + loss.VOCAB_SLICE].t() @ hc
        count = (targets != -100).sum().to(acc)
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_out.to(count.dtype) / count
        gw = torch.empty(grad_w.shape, dtype=ctx.weight_dtype)
        for v in range(0, grad_w.shape[0], loss.VOCAB_SLICE):
            gw[v:v + loss.VOCAB_SLICE] = grad_w[v:v + loss.VOCAB_SLICE] * scale
        return (grad_h * scale).to(grad_h.dtype), gw, None, None, None


def _before(h, w, t, rows):
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else h.dtype
    return _Before.apply(h, w, t, dtype, rows)


def _small_slices(monkeypatch, size: int) -> None:
    monkeypatch.setattr(loss, "VOCAB_SLICE", size)
    monkeypatch.setattr(loss_weight_grad, "VOCAB_SLICE", size)


def _inputs(v, d, n, h_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(h_dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.1).to(w_dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(h, w, t)
    gh, gw = torch.autograd.grad(out * 3.0, (h, w))
    return out, gh, gw


CASES = {  # (hidden states' dtype, weight's dtype, bf16 autocast)
    "fp32": (torch.float32, torch.float32, False),
    "fp32-weight-bf16-autocast": (torch.float32, torch.float32, True),
    "bf16-weight-bf16-autocast": (torch.bfloat16, torch.bfloat16, True),  # train.offload: bf16 weights
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "fp16-weight-fp32": (torch.float32, torch.float16, False),
    "fp64-weight-fp32": (torch.float32, torch.float64, False),  # wider than the sum: a buffer of its own
}


# a vocabulary of 517 in slices of 32 (blocks of 259 and 258 rows: the slice [256, 288) spans both), and one of
# three of the loss's own slices
SHAPES = [(case, 517, 32) for case in CASES] + [(case, 2 * 8192 + 3, None) for case in
                                                ("fp32-weight-bf16-autocast", "bf16-weight-bf16-autocast")]


@pytest.mark.parametrize(("case", "v", "slice_rows"), SHAPES, ids=[f"{c}-{v}" for c, v, _ in SHAPES])
def test_loss_and_gradients_are_bit_identical_to_a_separate_buffer(monkeypatch, case, v, slice_rows):
    if slice_rows:
        _small_slices(monkeypatch, slice_rows)
    h_dtype, w_dtype, autocast = CASES[case]
    h, w, t = _inputs(v, 24, 200, h_dtype, w_dtype)
    new = _loss_and_grads(lambda *a: linear_cross_entropy(*a, rows=128), h, w, t, autocast)
    old = _loss_and_grads(lambda *a: _before(*a, 128), h, w, t, autocast)
    for a, b in zip(new, old, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # and both near plain autograd over the whole logits
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = h @ w.to(h.dtype).t() if not autocast else h @ w.t()
    ref = F.cross_entropy(logits.double(), t, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref * 3.0, (h, w))
    tol = 2e-2 if torch.bfloat16 in (h_dtype, w_dtype) or autocast else 1e-3
    assert torch.allclose(new[0].double(), ref, rtol=tol)
    assert torch.allclose(new[1].double(), rh.double(), rtol=tol, atol=tol * rh.abs().max().item())
    assert torch.allclose(new[2].double(), rw.double(), rtol=tol, atol=tol * rw.abs().max().item())


class _NewStorages(TorchDispatchMode):
    """The bytes of every storage an op makes while it is on."""

    def __init__(self):
        super().__init__()
        self.seen, self.nbytes = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(x.untyped_storage().data_ptr())
                self.nbytes.append(x.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize(("w_dtype", "autocast"), [(torch.bfloat16, True), (torch.float32, True),
                                                   (torch.float32, False)], ids=["bf16", "fp32-autocast", "fp32"])
def test_the_backward_makes_no_second_vocabulary_sized_buffer(w_dtype, autocast):
    """The loss's backward held the projection's gradient twice: the fp32 sum and a copy in the weight's dtype
    (6 GB at a 256K vocabulary and d=4096 in bf16, 8 GB in fp32). Now `.grad` is the sum's own memory."""
    v, d = 3001, 64
    h, w, t = _inputs(v, d, 256, w_dtype, w_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = linear_cross_entropy(h, w, t, rows=128)
    sums = {x.untyped_storage().data_ptr() for x in out.grad_fn.saved_tensors if x.shape[-1:] == (d,)
            and x.dtype == torch.float32 and x.shape[0] > 256}
    seen = _NewStorages()
    seen.seen |= sums
    with seen:
        out.backward()
    assert max(seen.nbytes) < v * d * w.element_size() // 4  # a row or a slice at most, never (V, d)
    assert w.grad.untyped_storage().data_ptr() in sums  # autograd kept the sum's memory as .grad, no clone
    assert w.grad.is_contiguous() and w.grad.storage_offset() == 0 and w.grad.dtype == w_dtype
    assert w.grad.untyped_storage().nbytes() <= (v + 1) * d * w.element_size()  # no larger than a buffer of its own


def test_a_tied_weight_sums_both_gradients_and_takes_an_optimizer_step(monkeypatch):
    """Tied embeddings: the embedding's gradient is added to the one made in the sum's memory, and the result is an
    ordinary `.grad`: read flat by a post-accumulate-grad hook (as kiln.parallel.offload's is), stepped by AdamW."""
    _small_slices(monkeypatch, 32)
    v, d = 517, 24
    results = []
    for fn in (lambda *a: linear_cross_entropy(*a, rows=128), lambda *a: _before(*a, 128)):
        emb = torch.nn.Embedding(v, d, dtype=torch.bfloat16)
        with torch.no_grad():
            emb.weight.copy_(torch.randn(v, d, generator=torch.Generator().manual_seed(3)) * 0.1)
        ids = torch.randint(0, v, (300,), generator=torch.Generator().manual_seed(4))
        flat = []
        emb.weight.register_post_accumulate_grad_hook(lambda p, flat=flat: flat.append(p.grad.view(-1).clone()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(emb(ids) * 2.0, emb.weight, ids.roll(-1))
        out.backward()
        opt = torch.optim.AdamW(emb.parameters(), lr=1e-2)
        opt.step()
        results.append((flat[0], emb.weight.detach().clone()))
    (g_new, w_new), (g_old, w_old) = results
    assert torch.equal(g_new, g_old) and torch.equal(w_new, w_old)


def test_a_second_backward_through_a_retained_graph_says_why_it_cannot():
    h, w, t = _inputs(50, 8, 20, torch.float32, torch.float32)
    out = linear_cross_entropy(h, w, t)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward pass"):
        out.backward()
