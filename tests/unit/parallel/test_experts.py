"""Expert parallelism's parts in one process: the experts' written-out backward equals autograd's, the dispatch
operator over a one-process group computes and differentiates as the experts do (its gradient scale applied to
the weights alone), full checkpointing keeps its output instead of repeating it, and the settings it cannot
serve are refused with what to change. Two processes training, resuming and exporting with it:
tests/unit/parallel/test_parallelize.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kiln.config import RunConfig
from kiln.config.load import load_config
from kiln.errors import ConfigError
from kiln.model.moe import swiglu_experts
from kiln.parallel import experts
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import choose_strategy

E, D, H = 4, 16, 8
OFFS = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 has no rows


def _operands():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(20, D, generator=g, requires_grad=True), torch.randn(E, 2 * H, D, generator=g) / 4,
            torch.randn(E, D, H, generator=g) / 3)


def test_the_experts_written_out_backward_is_autograds():
    x, gate_up, down = _operands()
    gate_up.requires_grad_(), down.requires_grad_()
    out = swiglu_experts(x, gate_up, down, OFFS)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = experts.swiglu_backward(grad, x.detach(), gate_up.detach(), down.detach(), OFFS)
    for mine, ref in zip(got, (x.grad, gate_up.grad, down.grad), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    assert got[1][1].abs().max() == 0 and got[2][1].abs().max() == 0  # the expert without rows


def test_the_dispatch_operator_over_one_process_is_the_experts():
    x, gate_up, down = _operands()
    gate_up.requires_grad_(), down.requires_grad_()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        out = torch.ops.kiln.expert_parallel(x, OFFS, gate_up, down, group, 0.5)
        grad = torch.randn_like(out)
        out.backward(grad)
        got = (out.detach(), x.grad.clone(), gate_up.grad.clone(), down.grad.clone())
    finally:
        dist.destroy_process_group()
    x.grad = gate_up.grad = down.grad = None
    ref = swiglu_experts(x, gate_up, down, OFFS)
    ref.backward(grad)
    torch.testing.assert_close(got[0], ref.detach())
    torch.testing.assert_close(got[1], x.grad, rtol=1e-5, atol=1e-5)  # the rows' gradients unscaled
    torch.testing.assert_close(got[2], 0.5 * gate_up.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[3], 0.5 * down.grad, rtol=1e-5, atol=1e-5)


def test_full_checkpointing_keeps_the_dispatch_rather_than_repeating_its_all_to_alls(monkeypatch):
    """A block checkpointed in full recomputes everything in its backward pass, the dispatch too (its all-to-alls
    and host read once more) unless it is kept, as parallelize asks under expert parallelism; the gradients are the
    same either way."""
    from kiln.parallel.ac import _checkpointed

    x, gate_up, down = _operands()
    plans, plan = [], experts._plan
    monkeypatch.setattr(experts, "_plan", lambda *a: plans.append(1) or plan(*a))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group, grads = dist.group.WORLD.group_name, []
        for keep in (frozenset(), frozenset({experts.DISPATCH_OP})):
            plans.clear()
            x.grad = None
            block = _checkpointed(lambda t: torch.ops.kiln.expert_parallel(t * 2, OFFS, gate_up, down, group, 1.0),
                                  "full", keep=keep)
            block(x).square().sum().backward()
            grads.append((len(plans), x.grad.clone()))
    finally:
        dist.destroy_process_group()
    assert [n for n, _ in grads] == [3, 2]  # forward, (recomputation,) backward
    torch.testing.assert_close(grads[0][1], grads[1][1])


def _cfg() -> RunConfig:
    moe = {"n_experts": 4, "top_k": 2, "expert_hidden": 16}
    return RunConfig.model_validate({"model": {"size": "tiny", "moe": moe}, "dist": {"expert_parallel": 2}})


@pytest.mark.parametrize("overrides,said", [
    ([], "a model without experts \\(model.moe\\) is not supported with it"),
    (["model.moe.n_experts=3", "model.moe.top_k=1"], "must divide model.moe.n_experts=3"),
    (["model.moe.n_experts=4", "dist.strategy=ddp"], "needs dist.strategy=fsdp"),
    (["model.moe.n_experts=4", "dist.sharding=hybrid"], "does not support dist.sharding=hybrid"),
    (["model.moe.n_experts=4", "dist.cpu_offload=true"], "does not support dist.cpu_offload"),
    (["model.moe.n_experts=4", "lora.rank=4"], "LoRA is not supported"),
    (["model.moe.n_experts=4", "model.hf_class=auto"], "model.hf_class=auto is not supported"),
])
def test_settings_expert_parallelism_cannot_serve_are_config_errors(overrides, said):
    with pytest.raises(ConfigError, match=said):
        load_config(None, ["dist.expert_parallel=2", *overrides])


@pytest.mark.parametrize("world,moe,said", [
    (1, {}, "this run has one: start it with --nproc 2"),
    (4, {}, "must equal the number of processes \\(4\\)"),
    (2, None, "no native mixture of experts"),  # as model.init_from's config.json may say
    (2, {"n_experts": 5}, "must divide model.moe.n_experts=5"),
])
def test_at_build_expert_parallelism_needs_as_many_processes_and_the_experts_to_divide(world, moe, said):
    cfg = _cfg()
    if moe != {}:
        model = cfg.model.model_copy(update={"moe": moe if moe is None else cfg.model.moe.model_copy(update=moe)})
        cfg = cfg.model_copy(update={"model": model})
    with pytest.raises(ConfigError, match=said):
        experts.check(cfg, Mesh(world=world, local_world=world), "fsdp" if world > 1 else "single")


def test_auto_picks_fsdp_for_expert_parallelism():
    said: list[str] = []
    assert choose_strategy(_cfg(), Mesh(world=2, local_world=2), 1000, said.append) == "fsdp"
    assert "dist.expert_parallel=2" in said[0]
