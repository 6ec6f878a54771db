"""The hybrid (Nemotron-H) model on a GPU: each layer compiled whole (fullgraph: the SSD scan, the convolution and
the document masks inside, one graph per layer kind) computes what the eager model does, packed documents
included, and trains in bf16 as the eager one does."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer
from kiln.parallel.ac import apply_ac
from kiln.parallel.compile import apply_compile, compiled_graph_count

pytestmark = pytest.mark.gpu

CFG = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2, head_size=64, ffn_hidden=512,
                  mlp="relu2", layer_pattern="M-*M-M", tie_embeddings=False, max_seq_len=1024,
                  mamba=dict(heads=8, head_dim=64, state=64, groups=2, chunk=128))


def _batch(T=1000):  # not a multiple of the chunk: the scan pads its last one
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 4096, (2, T), device="cuda", generator=g)
    docs = torch.cat([torch.zeros(2, 300, dtype=torch.long), torch.ones(2, 450, dtype=torch.long),
                      torch.full((2, T - 750), 2)], dim=1).cuda()
    return x, docs


def test_compiled_layers_give_the_eager_loss_and_gradients_in_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 products on both sides
    x, docs = _batch()
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Transformer(CFG).cuda()
        apply_ac(model, "selective")
        if compiled:
            before = compiled_graph_count()
            apply_compile(model)
        loss = model(x, x, docs)
        loss.backward()
        out[compiled] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
        if compiled:
            # one graph per layer kind (3), the final norm, the loss kernel, the block-mask builder: a graph per
            # layer (a recompile for each of the 6) would make 9 or more
            assert compiled_graph_count() - before <= 8
    assert abs(out[True][0] - out[False][0]) < 1e-4
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_a_packed_document_gives_its_logits_alone_on_the_gpu():
    torch.manual_seed(0)
    model = Transformer(CFG).cuda().eval()
    apply_compile(model)
    x, docs = _batch()
    with torch.no_grad():
        packed = model(x, doc_ids=docs)
        alone = model(x[:, 300:750])
    torch.testing.assert_close(packed[:, 300:750], alone, rtol=1e-4, atol=1e-4)


def test_compiled_hybrid_trains_in_bf16_as_the_eager_one():
    x, docs = _batch()
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Transformer(CFG).cuda().train()
        if compiled:
            apply_compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x, docs)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[compiled] = run
    assert losses[True][-1] < losses[True][0] - 0.1
    for a, b in zip(losses[False], losses[True]):
        assert abs(a - b) < 0.05 * abs(a)
