"""Document masking: a token's output depends only on earlier tokens of its own document."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer
from kiln.model.masks import attend, doc_mask


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(size="tiny", vocab_size=256)).eval()


def _row(T=48, cut=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, T), generator=g)
    doc_ids = torch.zeros(2, T, dtype=torch.int32)
    doc_ids[0, cut:] = 1  # row 0: two documents; row 1: three, cut at 10 and 30
    doc_ids[1, 10:] = 1
    doc_ids[1, 30:] = 2
    return tokens, doc_ids


@torch.no_grad()
def test_logits_do_not_depend_on_previous_documents(model):
    tokens, doc_ids = _row()
    other = tokens.clone()
    other[0, :20] = (other[0, :20] + 7) % 256  # change the first document of row 0
    other[1, :30] = (other[1, :30] + 11) % 256  # and the first two of row 1
    a, b = model(tokens, doc_ids=doc_ids), model(other, doc_ids=doc_ids)  # (B, T, V)
    torch.testing.assert_close(a[0, 20:], b[0, 20:], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1, 30:], b[1, 30:], rtol=0, atol=1e-5)
    assert not torch.allclose(a[0, :20], b[0, :20])  # the changed document itself does change
    # without the mask the same positions see the changed tokens: the test above can fail
    c, d = model(tokens), model(other)
    assert (c[0, 20:] - d[0, 20:]).abs().max() > 1e-3


@torch.no_grad()
def test_masked_document_equals_document_alone(model):
    """The second document of a packed row gets the same logits as when it is run on its own,
    up to the position shift, which rotary embeddings make irrelevant."""
    tokens, doc_ids = _row()
    packed = model(tokens[:1], doc_ids=doc_ids[:1])[0, 20:]
    alone = model(tokens[:1, 20:])[0]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_one_document_is_plain_causal(model):
    tokens, _ = _row()
    ones = torch.zeros_like(tokens, dtype=torch.int32)
    torch.testing.assert_close(model(tokens, doc_ids=ones), model(tokens), rtol=1e-5, atol=1e-5)


def test_mask_shape_and_gradients(model):
    tokens, doc_ids = _row()
    mask = doc_mask(doc_ids)
    assert mask.shape == (2, 1, 48, 48) and mask.dtype == torch.bool
    assert not mask[0, 0, 25, 5] and mask[0, 0, 25, 21] and not mask[0, 0, 21, 25]
    loss = model(tokens, tokens.roll(-1, 1), doc_ids)
    loss.backward()
    assert torch.isfinite(loss) and model.embed_tokens.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_attend_grouped_query_heads():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 16, 8, generator=g) for h in (4, 2, 2))
    ids = torch.tensor([[0] * 6 + [1] * 10], dtype=torch.int32)
    out = attend(q, k, v, doc_mask(ids))
    ref = attend(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :])
    torch.testing.assert_close(out[..., 6:, :], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_block_mask_builder_compiles_a_bounded_number_of_graphs_for_many_batch_sizes(monkeypatch):
    """Auto-batch trials, OOM halving and evaluation build masks for many batch sizes: the compiled builder
    must not compile a graph per size (past torch's recompile limit it builds the mask eagerly, densely).
    Dynamo decides what recompiles, whatever the backend: the eager backend keeps this on the CPU and fast."""
    import functools

    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    from kiln.model import masks

    monkeypatch.setattr(masks, "_block_mask_builder", functools.partial(masks._block_mask_builder, "eager"))
    torch._dynamo.reset()
    T, cpu = 256, torch.device("cpu")
    graphs = counters["stats"]["unique_graphs"]
    for B in (2, 3, 5, 8, 4, 11, 7, 16, 6, 9):
        ids = (torch.rand(B, T, generator=torch.Generator().manual_seed(B)) < 0.02).int().cumsum(1).int()
        eager = create_block_mask(_same_doc_causal(ids), B, None, T, T, cpu)  # not compiled
        built = masks.block_mask(ids, cpu)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):  # the same bits
            torch.testing.assert_close(getattr(built, name), getattr(eager, name), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] - graphs <= 2, "the mask builder compiled a graph per batch size"


def _same_doc_causal(ids):
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    return mod
