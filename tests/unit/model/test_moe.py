"""kiln.model.moe: the grouped products, the routed layer against a token-by-token reference, the router losses in
the objective, packed documents, and the active-parameter FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig, MoEConfig
from kiln.model.llama import Transformer
from kiln.model.moe import SparseMoE, grouped_mm, grouped_mm_loop, hopper_or_newer, router_losses
from kiln.model.registry import active_param_count, flops_per_token, param_count


def _cfg(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                       moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, **moe))


def test_grouped_products_match_one_product_per_row_eager_and_compiled_form():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # group 1 is empty
    group = [0, 0, 0, 2, 2, 2, 2, 3, 3, 3]
    want = torch.stack([w[group[i]] @ x[i] for i in range(10)])
    torch.testing.assert_close(grouped_mm(x, w, offs), want)
    compiled_form = torch.compile(grouped_mm_loop, backend="eager", fullgraph=True)  # no host read in the graph
    torch.testing.assert_close(compiled_form(x, w, offs), want)
    # the GPU check traces as a constant: a whole-graph compile does not break on it
    checked = torch.compile(lambda t: t + int(hopper_or_newer(0)), backend="eager", fullgraph=True)
    assert torch.equal(checked(x), x + int(hopper_or_newer(0)))


@pytest.mark.parametrize("norm_topk, shared", [(True, None), (False, 24)])
def test_routed_layer_matches_a_token_by_token_reference(norm_topk, shared):
    cfg = _cfg(norm_topk=norm_topk, shared_expert_hidden=shared)
    torch.manual_seed(0)
    model = Transformer(cfg)
    layer = model.layers[0].mlp
    assert isinstance(layer, SparseMoE)
    x = torch.randn(2, 5, 32, requires_grad=True)
    y, stats = layer(x)
    E, wgu, wd = layer.experts.n_experts, layer.experts.gate_up_proj, layer.experts.down_proj
    want = []
    for t in x.reshape(-1, 32):
        p = torch.softmax(layer.gate.weight @ t, dim=-1)
        top, idx = p.topk(2)
        top = top / top.sum() if norm_topk else top
        out = sum(wt * (wd[e] @ (F.silu((wgu[e] @ t)[:16]) * (wgu[e] @ t)[16:])) for wt, e in zip(top, idx))
        if shared:
            se = layer.shared_expert
            out = out + torch.sigmoid(layer.shared_expert_gate.weight @ t) * se(t)
        want.append(out)
    torch.testing.assert_close(y.reshape(-1, 32), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert stats.shape == (2 * E + 1,) and stats[:E].sum() == 10 * 2  # every token counted top_k times
    y.sum().backward()
    assert wgu.grad is not None and layer.gate.weight.grad.abs().sum() > 0


def test_router_losses_enter_the_objective_and_are_kept_for_the_logs():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 16))
    losses = {}
    for aux, z in ((0.0, 0.0), (0.5, 0.0), (0.5, 0.25)):
        torch.manual_seed(0)
        model = Transformer(_cfg(aux_loss_coef=aux, z_loss_coef=z)).train()
        losses[aux, z] = model(x, x)
        kept_aux, kept_z = model.router_aux.take(), model.router_z.take()
    assert kept_aux > 0 and kept_z > 0
    torch.testing.assert_close(losses[0.5, 0.0] - losses[0.0, 0.0], 0.5 * kept_aux)
    torch.testing.assert_close(losses[0.5, 0.25] - losses[0.5, 0.0], 0.25 * kept_z)
    model.eval()  # evaluation: the cross-entropy alone
    torch.testing.assert_close(model(x, x), losses[0.0, 0.0])
    # perfectly balanced routing gives k; all tokens on one expert with all the probability gives E
    E, n = 4, 8
    balanced = torch.cat([torch.full((E,), 2.0 * n / E), torch.full((E,), n / E), torch.zeros(1)])
    skewed = torch.cat([torch.tensor([2.0 * n, 0, 0, 0]), torch.tensor([float(n), 0, 0, 0]), torch.zeros(1)])
    assert router_losses([balanced], E, n)[0].item() == pytest.approx(2.0)
    assert router_losses([skewed, skewed], E, n)[0].item() == pytest.approx(2.0 * E)


@torch.no_grad()
def test_a_packed_document_does_not_see_the_one_before_it():
    torch.manual_seed(0)
    model = Transformer(_cfg()).eval()
    tokens = torch.randint(0, 64, (1, 24))
    doc_ids = torch.zeros(1, 24, dtype=torch.int32)
    doc_ids[0, 10:] = 1
    other = tokens.clone()
    other[0, :10] = (other[0, :10] + 5) % 64
    a, b = model(tokens, doc_ids=doc_ids), model(other, doc_ids=doc_ids)
    torch.testing.assert_close(a[0, 10:], b[0, 10:], rtol=0, atol=1e-5)
    assert not torch.allclose(model(tokens)[0, 10:], model(other)[0, 10:])  # unmasked, they would differ


def test_counts_and_flops_use_the_active_experts():
    cfg = _cfg(shared_expert_hidden=24, dense_layers=[1])
    model = Transformer(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    expert = 3 * 32 * 16
    assert param_count(cfg) - active_param_count(cfg) == (4 - 2) * expert  # one MoE layer: two experts idle
    # the planner's blockless model (n_layers 0) keeps the embeddings and the final norm alone
    assert param_count(cfg.model_copy(update={"n_layers": 0})) == 64 * 32 + 32  # tied
    dense = cfg.model_copy(update={"moe": None})
    assert flops_per_token(cfg, 32) - flops_per_token(dense, 32) == pytest.approx(
        6 * (active_param_count(cfg) - param_count(dense)))


@pytest.mark.slow  # traces and differentiates a block whole (AOT autograd; inductor's code generation is left out)
def test_a_compiled_moe_block_matches_eager_forward_and_backward():
    torch.manual_seed(0)
    model = Transformer(_cfg(shared_expert_hidden=24))
    x = torch.randint(0, 64, (2, 16))
    model.train()
    eager = model(x, x)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for block in model.layers:
        block.compile(fullgraph=True, backend="aot_eager")
    compiled = model(x, x)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """The operators a step runs that make the host wait for the device: a scalar read (`.item()`, `int()`,
    `bool()`), outputs whose size depends on values (nonzero, boolean-mask indexing, unique, bincount,
    repeat_interleave without its output size)."""

    SIZED_BY_VALUES = ("nonzero", "masked_select", "_unique", "unique_", "bincount", "histc", "argwhere")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        indices = args[1] if name.startswith("index.") and len(args) > 1 else ()
        if ("_local_scalar_dense" in name or any(op in name for op in self.SIZED_BY_VALUES)
                or ("repeat_interleave" in name and kwargs.get("output_size") is None)
                or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)):
            self.seen.append(name)
        return func(*args, **kwargs)


def test_a_moe_training_forward_and_backward_make_no_host_read():
    """Routing, the router losses and the loss stay on the device: nothing in a step's forward and backward waits
    for the GPU (the CPU's loop over the experts, one opaque operator, reads its row ends; the kernel does not)."""
    torch.manual_seed(0)
    model = Transformer(_cfg(z_loss_coef=0.01, shared_expert_hidden=24)).train()
    x = torch.randint(0, 64, (2, 16))
    with _HostReads() as reads:
        model(x, x).backward()
        model.router_aux.add(torch.ones(()))
    assert reads.seen == []
    with _HostReads() as reads:  # the detector sees what it looks for
        torch.nonzero(x > 3), int(x.sum()), x[x > 3], x[0].repeat_interleave(x[0])
    assert reads.seen == ["nonzero.default", "_local_scalar_dense.default", "index.Tensor",
                          "repeat_interleave.Tensor"]


def test_a_compiled_moe_block_has_no_graph_break():
    """Each block is compiled whole: a graph break would split it into several graphs with host work between."""
    import torch._dynamo

    torch.manual_seed(0)
    model = Transformer(_cfg(z_loss_coef=0.01))
    block = model.layers[0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(torch.randn(2, 16, 32), *model._rope(16), None)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
