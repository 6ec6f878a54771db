"""kiln.model.grouped_mm: the loop over the experts' rows gives one product per row, eager and compiled, with the
kernel's work (not G times it) and exact gradients; why the kernel is not used is said, once per reason."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.model import grouped_mm as gm
from kiln.model.moe import GroupedExperts


def test_the_loop_and_its_gradients_match_one_product_per_row():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # group 1 is empty; row 10 is past the last end
    group = [0, 0, 0, 2, 2, 2, 2, 3, 3, 3]
    want = torch.stack([w[group[i]] @ x[i] for i in range(10)] + [torch.zeros(6, dtype=torch.float64)])
    torch.testing.assert_close(gm.grouped_mm_loop(x, w, offs), want)
    assert torch.autograd.gradcheck(lambda a, b: gm.grouped_mm_loop(a, b, offs), (x, w))


def test_compiled_experts_multiply_each_row_by_its_own_expert_only():
    """The compiled block's expert products do the routed rows' work: a loop traced into the graph multiplied
    every row by all G experts' weights (G times the FLOPs: 128x for Qwen3-30B-A3B)."""
    torch.manual_seed(0)
    G, d, h, N = 8, 16, 8, 24
    experts = GroupedExperts(G, d, h)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(N, d, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 12, 12, 15, 20, 24], dtype=torch.int32)
    forward = FlopCounterMode(display=False)
    graphs = []

    def counted(graph, example_inputs):  # the graph torch's compiler traced, run as is, its FLOPs counted
        graphs.append(graph)

        def run(*args):
            with forward:
                return graph(*args)
        return run

    compiled = torch.compile(experts, backend=counted, fullgraph=True)
    y = compiled(x, offs)
    backward = FlopCounterMode(display=False)
    with backward:
        y.square().sum().backward()
    assert len(graphs) == 1
    routed = 2 * N * d * 2 * h + 2 * N * h * d  # each row: its expert's gate/up, then its down projection
    assert forward.get_total_flops() == routed
    assert backward.get_total_flops() == 2 * routed  # the inputs' and the weights' gradients
    torch.testing.assert_close(y, experts(x, offs))


def test_kernel_refusal_names_why_and_a_gpu_warns_once_per_reason(monkeypatch):
    x, w = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    assert "cpu" in gm.kernel_refusal(x, w) and not gm._grouped_kernel(x, w)
    monkeypatch.setattr(gm, "_warned", set())
    with pytest.warns(gm.ExpertsKernelWarning, match="because the operands are torch.float32"):
        assert gm.warn_once("the operands are torch.float32 and torch.float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gm.warn_once("the operands are torch.float32 and torch.float32")  # said once
    with pytest.warns(gm.ExpertsKernelWarning, match="older than Hopper"):
        gm.warn_once("the GPU is older than Hopper")
