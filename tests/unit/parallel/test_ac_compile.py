"""Activation checkpointing and compilation change neither the numbers nor the state-dict keys."""

from pathlib import Path

import pytest
import torch

from kiln.config import ModelConfig
from kiln.model import loss as loss_module
from kiln.model import masks
from kiln.model.llama import Transformer
from kiln.parallel.ac import apply_ac
from kiln.parallel.compile import apply_compile, compiled_graph_count, restore_loss_kernel

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


def test_selective_checkpointing_quiets_compiles_in_place_ops_warning_only():
    import logging

    log = logging.getLogger("torch._higher_order_ops.wrap")
    msg = "\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\nPlease make sure ..."
    apply_ac(Transformer(CFG), "selective")
    apply_ac(Transformer(CFG), "selective")
    assert len(log.filters) == 1  # once, however many models

    def record(text):
        return logging.LogRecord(log.name, logging.WARNING, __file__, 1, text, None, None)

    assert not log.filter(record(msg)) and log.filter(record("any other warning"))


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
    if scope == "model":  # the mask and the chunked loss run outside the graph (kiln.parallel.compile.eager_parts)
        assert masks.doc_mask._torchdynamo_disable and loss_module.linear_cross_entropy._torchdynamo_disable
    assert abs(loss - loss0) < 1e-5 * abs(loss0)
    for n in g0:
        assert torch.allclose(g[n], g0[n], rtol=1e-4, atol=1e-6), n


def test_restore_loss_kernel_undoes_the_swap():
    apply_compile(Transformer(CFG))
    assert loss_module.ChunkKernel.fn is not loss_module.chunk_loss_and_grad  # swapped, process-wide
    restore_loss_kernel()
    assert loss_module.ChunkKernel.fn is loss_module.chunk_loss_and_grad
    h, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    t = torch.randint(0, 32, (8,))
    want = torch.nn.functional.cross_entropy(h @ w.t(), t)
    assert torch.allclose(loss_module.linear_cross_entropy(h, w, t), want)  # a working loss again


def test_the_swap_does_not_leak_into_the_next_test(pytester):
    """Two tests run by pytest with this suite's conftest: the first compiles (the kernel is swapped
    for the process), the second finds the plain kernel again."""
    pytester.makeconftest((Path(__file__).parents[2] / "conftest.py").read_text())
    pytester.makepyfile(test_two="""
        from kiln.parallel.compile import apply_compile
        from kiln.config import ModelConfig
        from kiln.model import loss
        from kiln.model.llama import Transformer

        def test_compiles():
            apply_compile(Transformer(ModelConfig(size="tiny", vocab_size=256, max_seq_len=64)))
            assert loss.ChunkKernel.fn is not loss.chunk_loss_and_grad

        def test_then_plain():
            assert loss.ChunkKernel.fn is loss.chunk_loss_and_grad
    """)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
    assert loss_module.ChunkKernel.fn is loss_module.chunk_loss_and_grad


def test_each_kind_of_block_of_a_hybrid_model_has_room_for_its_graphs(monkeypatch):
    """Mamba, attention and MLP blocks share one forward: three kinds in training and evaluation passed torch's
    8 graphs per code, and the blocks past it failed under fullgraph."""
    import torch._dynamo.config as dynamo

    from kiln.config import ModelConfig
    from kiln.model.llama import Transformer
    from kiln.parallel.compile import MODES_PER_KIND, apply_compile

    monkeypatch.setattr(dynamo, "recompile_limit", 8)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=6, n_heads=2, ffn_hidden=64, mlp="relu2",
                      layer_pattern="M-*M-M", mamba=dict(heads=2, head_dim=16, state=8, groups=1, chunk=8))
    apply_compile(Transformer(cfg), loss=False)
    assert dynamo.recompile_limit == MODES_PER_KIND * 3
    monkeypatch.setattr(dynamo, "recompile_limit", 8)
    apply_compile(Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2)), loss=False)
    assert dynamo.recompile_limit == 8  # one kind: torch's default stands
