"""Activation checkpointing and compilation change neither the numbers nor the state-dict keys."""

import pytest
import torch

from kiln.config import ModelConfig
from kiln.dist.ac import apply_ac
from kiln.dist.compile import apply_compile, compiled_graph_count
from kiln.model.llama import Transformer

CFG = ModelConfig(size="tiny", vocab_size=256, max_seq_len=64)


def _step(mode="none", compile=False, doc_ids=None, scope="blocks"):
    torch.manual_seed(0)
    model = Transformer(CFG)
    keys = list(model.state_dict())
    apply_ac(model, mode)
    if compile:
        apply_compile(model, scope=scope)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (2, 64), generator=g), torch.randint(0, 256, (2, 64), generator=g)
    loss = model(x, y, doc_ids)
    loss.backward()
    assert list(model.state_dict()) == keys  # checkpoints see the same names
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_gives_identical_gradients(mode):
    docs = torch.tensor([[0] * 20 + [1] * 44, [0] * 64])
    loss0, g0 = _step("none", doc_ids=docs)
    loss, g = _step(mode, doc_ids=docs)
    assert loss == loss0
    assert all(torch.equal(g[n], g0[n]) for n in g0)


def test_checkpointing_rejects_unknown_mode_and_double_application():
    model = Transformer(CFG)
    with pytest.raises(ValueError, match="not one of none, selective, full"):
        apply_ac(model, "some")
    apply_ac(model, "full")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_ac(model, "selective")


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_matches_eager_on_cpu(scope):
    docs = torch.tensor([[0] * 20 + [1] * 44, [0] * 64])
    loss0, g0 = _step("none", doc_ids=docs)
    before = compiled_graph_count()
    loss, g = _step("selective", compile=True, doc_ids=docs, scope=scope)
    assert compiled_graph_count() > before  # it really compiled
    assert abs(loss - loss0) < 1e-5 * abs(loss0)
    for n in g0:
        assert torch.allclose(g[n], g0[n], rtol=1e-4, atol=1e-6), n
