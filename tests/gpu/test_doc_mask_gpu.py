"""Document masking on CUDA (flex attention with a block mask) agrees with the SDPA boolean mask,
in eager and compiled models, with doc_ids given on the CPU (as the loader gives them) or the GPU."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer
from kiln.model.masks import attend, block_mask, dense_mask
from kiln.parallel.compile import apply_compile, compiled_graph_count

pytestmark = pytest.mark.gpu


def _doc_ids(B, T, seed=0, rate=0.01):
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, T, generator=g) < rate).int()
    starts[:, 0] = 0
    return starts.cumsum(1).int()


@pytest.mark.parametrize("on_gpu", [False, True], ids=["doc_ids-cpu", "doc_ids-gpu"])
@pytest.mark.parametrize("T,hd,heads", [(256, 64, (8, 2, 2)), (1000, 128, (8, 8, 8)), (2048, 64, (12, 12, 12))])
def test_flex_mask_matches_sdpa_dense_mask(on_gpu, T, hd, heads):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, T, hd, generator=g).cuda().bfloat16().requires_grad_() for h in heads)
    ids = _doc_ids(2, T)
    dy = torch.randn(2, heads[0], T, hd, generator=g).cuda().bfloat16()
    out = attend(q, k, v, block_mask(ids.cuda() if on_gpu else ids, torch.device("cuda")))
    grads = torch.autograd.grad(out, (q, k, v), dy)
    ref = attend(q, k, v, dense_mask(ids, torch.device("cuda")))
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("with_docs", [True, False], ids=["docs", "no-docs"])
@pytest.mark.parametrize("window", [1, 100, 255])
def test_flex_sliding_window_matches_sdpa_dense_mask(with_docs, window):
    """A sliding window (Mistral) joins the flex block mask as it joins the dense one."""
    T, hd, h = 512, 64, 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, T, hd, generator=g).cuda().bfloat16().requires_grad_() for _ in range(3))
    ids = _doc_ids(2, T, rate=0.005) if with_docs else None
    dy = torch.randn(2, h, T, hd, generator=g).cuda().bfloat16()
    dev = torch.device("cuda")
    out = attend(q, k, v, block_mask(ids, dev, window, T))
    ref = attend(q, k, v, dense_mask(ids, dev, window, T))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
    full = attend(q, k, v, dense_mask(ids, dev, None, T))
    assert (ref - full).abs().max() > 1e-2  # control: the window changes the result


def test_model_logits_independent_of_previous_document_on_gpu():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=256)).cuda().eval()
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    ids = torch.zeros(2, 128, dtype=torch.int32)
    ids[:, 50:] = 1
    other = tokens.clone()
    other[:, :50] = (other[:, :50] + 3) % 256
    with torch.no_grad():
        a, b = model(tokens, doc_ids=ids), model(other, doc_ids=ids)
        unmasked_a, unmasked_b = model(tokens), model(other)
    torch.testing.assert_close(a[:, 50:], b[:, 50:], rtol=1e-4, atol=1e-4)
    assert (unmasked_a[:, 50:] - unmasked_b[:, 50:]).abs().max() > 1e-3  # control: without the mask they differ
    loss = model.train()(tokens, tokens.roll(-1, 1), ids)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("scope", ["blocks", "model"])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_compiled_model_keeps_the_document_mask_without_recompiling(scope, bf16):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=256)).cuda()
    tokens = torch.randint(0, 256, (2, 256), device="cuda")
    batches = [_doc_ids(2, 256, seed=s, rate=r) for s, r in ((3, 0.01), (4, 0.03), (5, 0.001))]
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad(), amp:
        eager = [model(tokens, doc_ids=ids) for ids in batches]
    apply_compile(model, scope=scope)
    with torch.no_grad(), amp:
        compiled = [model(tokens, doc_ids=batches[0])]
        graphs = compiled_graph_count()
        compiled += [model(tokens, doc_ids=ids) for ids in batches[1:]]  # other numbers of documents
    assert compiled_graph_count() == graphs, "a new number of documents recompiled the model"
    tol = 3e-2 if bf16 else 2e-3
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c.float(), e.float(), rtol=tol, atol=tol)
    with amp:
        loss = model(tokens, tokens.roll(-1, 1), batches[1])  # and it trains
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
