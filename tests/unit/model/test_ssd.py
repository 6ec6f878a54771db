"""The chunked SSD scan against the recurrence it computes, taken one position at a time."""

import pytest
import torch

from kiln.model.ssd import segment_sums, ssd_scan


def recurrence(x, dt, A, B, C, docs=None):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t, with S zero at each document's start."""
    b, T, H, P = x.shape
    R = H // B.shape[2]
    Bh, Ch = B.repeat_interleave(R, dim=2), C.repeat_interleave(R, dim=2)  # (b, T, H, N)
    S = torch.zeros(b, H, P, B.shape[-1])
    out = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)  # (b, H)
        if t == 0:
            decay = torch.zeros_like(decay)
        elif docs is not None:
            decay = decay * (docs[:, t] == docs[:, t - 1]).float()[:, None]
        S = decay[..., None, None] * S + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        out.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    return torch.stack(out, dim=1)


def inputs(b=2, T=23, H=4, P=3, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, H, P, generator=g)
    B, C = torch.randn(b, T, G, N, generator=g), torch.randn(b, T, G, N, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, T, H, generator=g))
    A = -torch.rand(H, generator=g) * 2 - 0.1
    return x, dt, A, B, C


@pytest.mark.parametrize("chunk", [4, 7, 64])  # several chunks with a padded last one; one chunk longer than T
def test_scan_equals_the_recurrence_with_documents(chunk):
    x, dt, A, B, C = inputs()
    docs = torch.tensor([[0] * 5 + [1] * 11 + [2] * 7, [0] * 23])  # boundaries inside and at the edge of chunks
    for d in (None, docs):
        want = recurrence(x, dt, A, B, C, d)
        got = ssd_scan(x, dt, A, B, C, chunk, d)
        assert (got - want).abs().max() < 1e-5


def test_a_document_gives_what_it_gives_alone():
    x, dt, A, B, C = inputs(b=1, T=20)
    docs = torch.tensor([[0] * 9 + [1] * 11])
    packed = ssd_scan(x, dt, A, B, C, 4, docs)
    alone = ssd_scan(x[:, 9:], dt[:, 9:], A, B[:, 9:], C[:, 9:], 4)
    assert (packed[:, 9:] - alone).abs().max() < 1e-5
    # without the ids the second document reads the first one's state
    assert (ssd_scan(x, dt, A, B, C, 4)[:, 9:] - alone).abs().max() > 1e-2


def test_gradients_are_the_recurrences():
    """The -inf masks of the chunked form give no NaN in the backward pass, and the gradients are exact."""
    tensors = inputs(T=13)
    docs = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])
    grads = []
    for fn in (lambda *t: recurrence(*t, docs), lambda *t: ssd_scan(*t, 4, docs)):
        leaves = [t.clone().requires_grad_() for t in tensors]
        fn(*leaves).square().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for want, got in zip(*grads):
        assert torch.isfinite(got).all() and (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_segment_sums():
    a = torch.tensor([1.0, 2.0, 3.0])
    s = segment_sums(a)
    inf = float("-inf")
    assert torch.equal(s, torch.tensor([[0.0, inf, inf], [2.0, 0.0, inf], [5.0, 3.0, 0.0]]))


def test_bf16_inputs_keep_the_state_in_fp32():
    """In bf16 (as under autocast on a GPU) the two large products round to bf16; the decays and states stay fp32,
    so the result is within bf16's rounding of the fp32 one, however many chunks the state passes through."""
    x, dt, A, B, C = inputs(b=1, T=64, H=4, P=8, G=2, N=8)
    want = ssd_scan(x, dt, A, B, C, 8)
    got = ssd_scan(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), 8)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 3e-2 * want.abs().max()
