"""The mixture of experts on a GPU: torch's grouped GEMM gives the loop's products in bf16, and a compiled MoE block
(inductor, grouped GEMMs inside, no host sync), with selective activation checkpointing too, trains as the eager
one does."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig, MoEConfig
from kiln.model import moe
from kiln.model.llama import Transformer
from kiln.parallel.ac import apply_ac

pytestmark = pytest.mark.gpu


def test_grouped_gemm_is_used_and_matches_the_loop_in_bf16_forward_and_backward():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM serves Hopper and newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.tensor([0, 37, 5, 300, 1, 0, 129, 40], device="cuda")  # empty and odd-sized groups
    offs = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(int(sizes.sum()), 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8, 384, 256, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    assert moe._grouped_kernel(x, w)
    out = moe.grouped_mm(x, w, offs)
    out.float().square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want = moe.grouped_mm_loop(x, w, offs)
    want.float().square().sum().backward()
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, x.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gw, w.grad, rtol=2e-2, atol=5e-1)
    assert gw[0].abs().sum() == 0 and gw[5].abs().sum() == 0  # experts without tokens get no gradient


def test_compiled_moe_blocks_train_as_eager_ones_in_bf16():
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
                      max_seq_len=512, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=256))
    x = torch.randint(0, 4096, (4, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    losses = {}
    for compiled in (False, True, "selective AC"):
        torch.manual_seed(0)
        model = Transformer(cfg).cuda().train()
        if compiled == "selective AC":  # the grouped products kept for the backward pass, the rest recomputed
            apply_ac(model, "selective")
        if compiled:
            for block in model.layers:
                block.compile(fullgraph=True)  # the whole block in one graph: no host read of the expert sizes
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[compiled] = run
        assert model.router_aux.take() > 0
    assert losses[True][-1] < losses[True][0]
    for other in (True, "selective AC"):
        for a, b in zip(losses[False], losses[other]):
            assert abs(a - b) < 0.05 * abs(a), losses
