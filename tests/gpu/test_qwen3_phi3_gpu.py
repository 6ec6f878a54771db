"""Native Qwen3 (q/k norms, a head width of its own) and Phi-3 (fused projections, a sliding window) on CUDA:
compiled per block in bf16 with flex-attention document masks they give the eager logits, a packed document
gives what it gives alone, and a new number of documents does not recompile."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer
from kiln.parallel.compile import apply_compile, compiled_graph_count

pytestmark = pytest.mark.gpu

SHAPE = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512, vocab_size=512, max_seq_len=512)
LAYOUTS = {"qwen3": dict(qk_norm=True, head_size=128, hf_model_type="qwen3"),
           "phi3": dict(fused_projections=True, sliding_window=64, hf_model_type="phi3")}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_compiled_bf16_with_document_masks_matches_eager(family):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHAPE, **LAYOUTS[family])).cuda()
    tokens = torch.randint(0, 512, (2, 256), device="cuda")
    batches = []
    for cut in (100, 37, 200):
        ids = torch.zeros(2, 256, dtype=torch.int32)
        ids[:, cut:] = 1
        batches.append(ids)
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    with torch.no_grad(), amp:
        eager = [model(tokens, doc_ids=ids) for ids in batches]
        alone = model(tokens[:, 100:])
    torch.testing.assert_close(eager[0][:, 100:].float(), alone.float(), rtol=3e-2, atol=3e-2)
    apply_compile(model)
    with torch.no_grad(), amp:
        compiled = [model(tokens, doc_ids=batches[0])]
        graphs = compiled_graph_count()
        compiled += [model(tokens, doc_ids=ids) for ids in batches[1:]]
    assert compiled_graph_count() == graphs, "another document boundary recompiled the model"
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c.float(), e.float(), rtol=3e-2, atol=3e-2)
    with amp:
        loss = model(tokens, tokens.roll(-1, 1), batches[1])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
