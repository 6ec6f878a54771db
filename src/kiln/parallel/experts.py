"""Expert parallelism (dist.expert_parallel): each process keeps whole experts of every mixture-of-experts layer,
and the tokens travel to their experts instead of every expert's weights to every process.

Under FSDP alone each step all-gathers and reduce-scatters every expert of every layer (12B parameters at the
Qwen3-30B-A3B shape) although a token uses top_k of them. With expert parallelism over the run's P processes,
process r owns experts [r E/P, (r + 1) E/P) of each layer, and the layer's rows (each token once per chosen
expert, sorted by expert: kiln.model.moe.SparseMoE) go where their expert lives and come back:

    rows (N k, d), sorted by expert ──all-to-all──► every process's rows for my experts (R, d), regrouped by expert
                                                    through my experts' SwiGLU (grouped GEMMs: swiglu_experts)
    outputs (N k, d), same order    ◄──all-to-all── their outputs, in the order they came

The router, its load-balancing statistics and the weighted sum of each token's k outputs stay in the model, before
and after this: they are the same as without it.

Parameters: an expert layer's `gate_up_proj` (E, 2h, d) and `down_proj` (E, d, h) become DTensors sharded on dim 0
(the experts) over the run's mesh, the one FSDP2 shards the rest of the model over, and FSDP leaves them alone
(`ignored_params`): never gathered, their gradients never reduce-scattered. State dicts see them under their
names with their full shapes, so DCP checkpoints reshard them to any world size (or to FSDP without expert
parallelism: its Shard(0) of an (E, ...) tensor is the same layout), the Hugging Face export gathers them whole,
and the global gradient norm counts each expert once (a DTensor norm over the mesh, as FSDP's shards).

Gradients: the backward all-to-all brings every process's rows' gradients to the owner, so an expert's gradient is
the sum over the processes' losses; it is scaled by 1 / P, the average FSDP's reduce-scatter takes of the others.

Compile: the dispatch is one custom operator (`kiln::expert_parallel`), whose output has its input's shape, so a
compiled block keeps it whole (fullgraph) and never recompiles for it. The number of rows a process receives is
known only at run time: each layer first exchanges its per-expert row counts (one small all-to-all) and reads
them on the host (one sync per layer and pass), as every expert-parallel implementation must to size the rows'
all-to-all. Its backward operator repeats the rows' all-to-all and the gate/up products instead of keeping
tensors of run-time shapes between the two operators: one all-to-all more per layer, and the gate/up products
(two thirds of the experts' forward FLOPs) twice. Full activation checkpointing keeps this operator's output
(kiln.parallel.ac's `keep`) rather than repeating its all-to-alls in the recomputed block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from kiln.errors import ConfigError
from kiln.model.grouped_mm import grouped_mm, kernel_refusal
from kiln.model.moe import GroupedExperts, _compute_dtype, swiglu_experts

__all__ = ["ExpertParallelExperts", "check", "shard_experts", "swiglu_backward"]


class _Plan(NamedTuple):
    send: list[int]  # rows this process sends to each process
    recv: list[int]  # rows it receives from each
    order: torch.Tensor  # (R,) received rows (by process, then expert) -> rows grouped by local expert
    offs: torch.Tensor  # (E / P,) int32: the end of each local expert's rows in that order


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _plan(offs: torch.Tensor, group) -> _Plan:
    """Where this layer's rows go and what comes back, from each process's per-expert counts."""
    world = dist.get_world_size(group)
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # (E,) rows of each expert on this process
    incoming = torch.empty_like(counts)  # (P * E/P,): each process's rows for each of my experts
    dist.all_to_all_single(incoming, counts, group=group)
    # the one host read of a layer's pass: the rows' all-to-all needs its split sizes on the host (normal for EP)
    host = torch.cat([counts, incoming]).tolist()
    n, local = counts.numel(), counts.numel() // world
    send = [sum(host[i * local:(i + 1) * local]) for i in range(world)]
    recv = [sum(host[n + i * local:n + (i + 1) * local]) for i in range(world)]
    expert = torch.arange(local, device=offs.device).repeat(world)  # the local expert of each (process, expert)
    which = torch.repeat_interleave(expert, incoming, output_size=sum(recv))  # (R,)
    order = torch.argsort(which, stable=True)
    return _Plan(send, recv, order, incoming.view(world, local).sum(dim=0).cumsum(0).to(torch.int32))


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows grouped by local expert back in the order they were received."""
    return torch.empty_like(rows).index_copy_(0, order, rows)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The gradient of each group's weight w (G, M, K) of `grouped_mm(x, w, offs)` given its output's `grad`
    (N, M): torch's grouped GEMM over the rows where it served the product, else the loop over the groups."""
    if kernel_refusal(x, w) is None:
        return torch._grouped_mm(grad.t(), x, offs=offs)  # (G, M, K), as torch's own backward of the product
    return torch.ops.kiln.grouped_rows_weight_grad(grad, x, offs)


def swiglu_backward(grad: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `swiglu_experts(x, gate_up, down, offs)` for x, gate_up and down given its output's
    `grad`, written out: autograd does not record below a custom operator, where this runs."""
    gate, up = grouped_mm(x, gate_up, offs).chunk(2, dim=-1)  # (N, h) each: recomputed
    g, u = gate.float(), up.float()
    sig = torch.sigmoid(g)
    act = (g * sig * u).to(x.dtype)  # silu(gate) * up, the down projection's input
    grad_act = grouped_mm(grad, down.transpose(1, 2), offs).float()  # (N, h)
    grad_h = torch.cat([grad_act * u * sig * (1 + g * (1 - sig)), grad_act * g * sig], dim=-1).to(x.dtype)
    grad_x = grouped_mm(grad_h, gate_up.transpose(1, 2), offs)  # (N, d)
    return grad_x, _weight_grad(grad_h, x, gate_up, offs), _weight_grad(grad, act, down, offs)


@torch.library.custom_op("kiln::expert_parallel", mutates_args=())
def _dispatch(x: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, group: str,
              grad_scale: float) -> torch.Tensor:
    """x (N k, d) sorted by expert, offs (E,) int32 ends, gate_up / down this process's experts' weights -> each
    row through its expert's SwiGLU (N k, d), wherever that expert lives."""
    g = _group(group)
    plan = _plan(offs, g)
    rows = _exchange(x, plan.recv, plan.send, g)[plan.order]  # (R, d) grouped by local expert
    out = swiglu_experts(rows, gate_up, down, plan.offs) if rows.shape[0] else rows
    return _exchange(_unsort(out, plan.order), plan.send, plan.recv, g)


@_dispatch.register_fake
def _(x, offs, gate_up, down, group, grad_scale):
    return torch.empty_like(x)


@torch.library.custom_op("kiln::expert_parallel_backward", mutates_args=())
def _dispatch_backward(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, group: str, grad_scale: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """The gradients of `_dispatch` for x, gate_up and down (those two times grad_scale): the rows and their output
    gradients sent to the experts' owners, the local experts' backward, the rows' gradients sent back."""
    g = _group(group)
    plan = _plan(offs, g)
    rows = _exchange(x, plan.recv, plan.send, g)[plan.order]
    grad_rows = _exchange(grad, plan.recv, plan.send, g)[plan.order]
    if rows.shape[0]:
        grad_rows, grad_gate_up, grad_down = swiglu_backward(grad_rows, rows, gate_up, down, plan.offs)
    else:  # no row of any process chose my experts
        grad_gate_up, grad_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    grad_x = _exchange(_unsort(grad_rows, plan.order), plan.send, plan.recv, g)
    # contiguous, as the fake implementation says (the grouped GEMM may lay a weight gradient out otherwise)
    return grad_x, (grad_gate_up * grad_scale).contiguous(), (grad_down * grad_scale).contiguous()


@_dispatch_backward.register_fake
def _(grad, x, offs, gate_up, down, group, grad_scale):
    return torch.empty_like(x), torch.empty_like(gate_up), torch.empty_like(down)


def _setup(ctx, inputs, output) -> None:
    x, offs, gate_up, down, group, grad_scale = inputs
    ctx.save_for_backward(x, offs, gate_up, down)
    ctx.group, ctx.grad_scale = group, grad_scale


def _backward(ctx, grad: torch.Tensor):
    x, offs, gate_up, down = ctx.saved_tensors
    grad_x, grad_gate_up, grad_down = torch.ops.kiln.expert_parallel_backward(
        grad.contiguous(), x, offs, gate_up, down, ctx.group, ctx.grad_scale)
    return grad_x, None, grad_gate_up, grad_down, None, None


_dispatch.register_autograd(_backward, setup_context=_setup)
DISPATCH_OP = torch.ops.kiln.expert_parallel.default  # as a checkpoint policy sees it (kiln.parallel.ac)


PARTS = ("gate_up_proj", "down_proj")


class ExpertParallelExperts(GroupedExperts):
    """A GroupedExperts holding this process's experts (DTensor shards over the mesh) whose rows go to the process
    owning their expert (`kiln::expert_parallel`). `shard_experts` turns a GroupedExperts into one in place.

    The forward pass computes with `local`: for each part, a plain leaf tensor sharing the DTensor shard's memory,
    made before the model's forward (`refresh`, outside any compiled graph), whose gradient is moved onto the
    DTensor parameter's as it is accumulated. A DTensor read inside a compiled, checkpointed block (its
    to_local) fails in torch's compiler; plain tensors compile as the rest of the block does."""

    group: str  # the process group's name (the mesh's): the operator's argument
    grad_scale: float  # 1 / processes: the average FSDP takes of the other gradients
    local: dict[str, torch.Tensor]

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x (N k, d): rows sorted by expert (all E), offs (E,) int32 ends -> (N k, d)."""
        dtype = _compute_dtype(x, self.gate_up_proj)  # bf16 products on fp32 masters, as FSDP's mixed precision
        gate_up, down = self.local["gate_up_proj"].to(dtype), self.local["down_proj"].to(dtype)
        return torch.ops.kiln.expert_parallel(x.to(dtype), offs, gate_up, down, self.group, self.grad_scale)

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)make the leaves of `local` where a parameter's shard is not theirs (the first pass, or after
        materialisation or a load that replaced it)."""
        for name in PARTS:
            param = getattr(self, name)
            shard = param.to_local()
            leaf = self.local.get(name)
            if leaf is not None and leaf.data_ptr() == shard.data_ptr() and leaf.shape == shard.shape:
                continue
            leaf = shard.detach().requires_grad_(param.requires_grad)  # the same memory: optimizer steps show
            if param.requires_grad:
                leaf.register_post_accumulate_grad_hook(functools.partial(_onto_param, param))
            self.local[name] = leaf

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, expert_parallel={round(1 / self.grad_scale)}"


@torch.no_grad()
def _onto_param(param: nn.Parameter, leaf: torch.Tensor) -> None:
    """Move the gradient a backward pass accumulated on `leaf` onto `param` (a DTensor), adding to one there."""
    from torch.distributed.tensor import DTensor

    grad, leaf.grad = leaf.grad, None
    if param.grad is None:
        param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
    else:
        param.grad.to_local().add_(grad)


def _refresh_all(modules: list[ExpertParallelExperts]):
    def hook(model, args):
        for module in modules:
            module.refresh()
    return hook


def check(cfg, m, strategy: str) -> None:
    """ConfigError, before anything is sharded, for a run whose dist.expert_parallel (above 1) cannot apply."""
    d, mc = cfg.dist, cfg.model
    ep = d.expert_parallel
    if not m.distributed:
        raise ConfigError(f"dist.expert_parallel={ep} spreads the experts over {ep} processes; this run has one: start "
                          f"it with --nproc {ep}, or set dist.expert_parallel=1")
    if ep != m.world:
        raise ConfigError(f"dist.expert_parallel={ep} must equal the number of processes ({m.world}): the experts are "
                          "spread over every process, the rest of the model sharded by FSDP over the same ones "
                          f"(expert parallelism over a part of them is not supported); set dist.expert_parallel="
                          f"{m.world}, or 1")
    if mc.moe is None or mc.hf_class == "auto":
        raise ConfigError(f"dist.expert_parallel={ep}: the model has no native mixture of experts (model.moe"
                          f"{', and model.hf_class=auto runs transformers modules' if mc.hf_class == 'auto' else ''}); "
                          "set dist.expert_parallel=1")
    if mc.moe.n_experts % ep:
        raise ConfigError(f"dist.expert_parallel={ep} must divide model.moe.n_experts={mc.moe.n_experts} (each "
                          "process keeps the same number of whole experts); choose a divisor, or 1")
    refusals = [(strategy != "fsdp", f"dist.strategy={strategy}: it needs fsdp (or auto), which shards the rest"),
                (d.sharding == "hybrid", "dist.sharding=hybrid is not supported with it: use full or grad_op"),
                (d.cpu_offload, "dist.cpu_offload is not supported with it: remove one of the two"),
                (cfg.lora.rank > 0, "LoRA (lora.rank > 0) is not supported with it: set dist.expert_parallel=1")]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"dist.expert_parallel={ep}: {why}")


@torch.no_grad()
def shard_experts(model: nn.Module, m) -> set[nn.Parameter]:
    """Turn each GroupedExperts of `model` (on the meta device or not) into this process's share of its experts,
    in place, before FSDP shards the rest: returns the expert parameters, for FSDP to ignore."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, group = m.mesh, m.mesh.get_group()
    rank, world = mesh.get_local_rank(), mesh.size()
    owned: set[nn.Parameter] = set()
    modules: list[ExpertParallelExperts] = []
    for module in model.modules():
        if not isinstance(module, GroupedExperts) or type(module) is ExpertParallelExperts:
            continue
        if type(module) is not GroupedExperts:
            raise ConfigError(f"dist.expert_parallel={world} does not support {type(module).__name__} (experts with "
                              "adapters); set dist.expert_parallel=1")
        for name in PARTS:
            p = getattr(module, name)
            per = p.shape[0] // world
            local = p[rank * per:(rank + 1) * per]
            local = local.clone() if local.is_meta else local.to(m.device).clone()
            shard = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
                                 requires_grad=p.requires_grad)
            setattr(module, name, shard)
            owned.add(shard)
        module.__class__ = ExpertParallelExperts
        module.group, module.grad_scale, module.local = group.group_name, 1.0 / world, {}
        modules.append(module)
    if modules:  # the compute leaves, made before each forward pass, outside the compiled blocks
        model.register_forward_pre_hook(_refresh_all(modules))
    return owned
