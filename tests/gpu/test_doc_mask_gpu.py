"""Document masking on CUDA (flex attention block mask) agrees with the SDPA boolean mask."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer
from kiln.model.masks import attend, doc_mask

pytestmark = pytest.mark.gpu


def _doc_ids(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, T, generator=g) < 0.01).int()
    starts[:, 0] = 0
    return starts.cumsum(1).int()


@pytest.mark.parametrize("T,hd", [(256, 64), (1000, 128)])
def test_flex_matches_sdpa_mask(T, hd):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, T, hd, generator=g).cuda().bfloat16() for h in (8, 2, 2))
    ids = _doc_ids(2, T).cuda()
    flex = attend(q, k, v, doc_mask(ids))
    dense = attend(q, k, v, doc_mask(ids.cpu()).cuda())
    torch.testing.assert_close(flex.float(), dense.float(), rtol=2e-2, atol=2e-2)


def test_model_logits_independent_of_previous_document_on_gpu():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=256)).cuda().eval()
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    ids = torch.zeros(2, 128, dtype=torch.int32, device="cuda")
    ids[:, 50:] = 1
    other = tokens.clone()
    other[:, :50] = (other[:, :50] + 3) % 256
    with torch.no_grad():
        a, b = model(tokens, doc_ids=ids), model(other, doc_ids=ids)
    torch.testing.assert_close(a[:, 50:], b[:, 50:], rtol=1e-4, atol=1e-4)
    loss = model.train()(tokens, tokens.roll(-1, 1), ids)
    loss.backward()
    assert torch.isfinite(loss)


def test_compiled_blocks_keep_the_document_mask():
    import warnings

    from kiln.dist.compile import apply_compile

    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=256)).cuda().eval()
    tokens = torch.randint(0, 256, (2, 256), device="cuda")
    ids = _doc_ids(2, 256, seed=3).cuda()
    with torch.no_grad():
        eager = model(tokens, doc_ids=ids)
    apply_compile(model, scope="blocks")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lru_cache.*")  # no cache wrapper traced by dynamo
        with torch.no_grad():
            compiled = model(tokens, doc_ids=ids)
    torch.testing.assert_close(compiled, eager, rtol=2e-3, atol=2e-3)
