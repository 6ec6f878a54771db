"""Parallelism applied to a plain model from outside, in the order that composes:

    float8 linear layers (train.fp8) -> activation checkpointing -> torch.compile (per block) -> FSDP2 / DDP

The model file knows nothing of it. `parallelize` returns the module the trainer drives: the
model itself (one process, or FSDP2, which changes the module's class in place and turns its
parameters into DTensors) or a `DistributedDataParallel` around it. State-dict keys stay those of
the plain model under every strategy (DCP's get_state_dict strips wrappers), so a checkpoint
moves between strategies and world sizes.

`kiln.parallel.materialize.build_model` builds the model for it: under FSDP on the meta device, sharded
here, then each process's shard materialised and initialised (drawn full-size one parameter at a time on
the run's device: the same weights on any world size); one process and DDP get a model on the CPU, moved
to the device here.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from kiln.config import RunConfig
from kiln.errors import ConfigError
from kiln.parallel import compile_cache, loss_kernel, offload_layers
from kiln.parallel.ac import apply_ac
from kiln.parallel.compile import apply_compile
from kiln.parallel.experts import DISPATCH_OP
from kiln.parallel.mesh import Mesh

BYTES_PER_PARAM = 16  # fp32 weights (4) + fp32 gradients (4) + AdamW's two fp32 moments (8)
FIT_FRACTION = 0.5  # model + optimizer may take this share of a device; the rest is for activations


def uses_bf16(cfg: RunConfig, device: torch.device) -> bool:
    p = cfg.train.precision
    return p == "bf16" or (p == "auto" and device.type == "cuda")


def device_memory(device: torch.device, local_world: int) -> int:
    """Bytes one process may use on `device` (a GPU's total; a CPU's RAM shared by the node's processes)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return ram // max(1, local_world)


def choose_strategy(cfg: RunConfig, m: Mesh, n_params: int, log: Callable[[str], None] = print) -> str:
    """'single', 'ddp' or 'fsdp' for this run; `auto` decides by memory and says why."""
    d = cfg.dist
    if not m.distributed:
        if d.strategy != "auto":
            log(f"dist.strategy={d.strategy} has no effect in a one-process run (start several with --nproc N)")
        return "single"
    if d.strategy != "auto":
        return d.strategy
    if d.expert_parallel > 1:
        log(f"dist.strategy auto: fsdp, because dist.expert_parallel={d.expert_parallel} is set")
        return "fsdp"
    if d.cpu_offload or d.sharding != "full":
        log(f"dist.strategy auto: fsdp, because dist.{'cpu_offload' if d.cpu_offload else 'sharding'} is set")
        return "fsdp"
    need, have = n_params * BYTES_PER_PARAM, device_memory(m.device, m.local_world)
    choice = "ddp" if need <= FIT_FRACTION * have else "fsdp"
    log(f"dist.strategy auto: {choice} (weights, gradients and AdamW state take {need / 2**30:.1f} GiB per "
        f"replica, {'within' if choice == 'ddp' else 'over'} {FIT_FRACTION:.0%} of the {have / 2**30:.0f} GiB of "
        f"{m.device.type}; set dist.strategy to choose)")
    return choice


def parallelize(model: nn.Module, cfg: RunConfig, m: Mesh, n_params: int | None = None,
                log: Callable[[str], None] = print, strategy: str | None = None) -> nn.Module:
    """Apply float8 (train.fp8), AC, compile and the run's strategy (`strategy`, else `choose_strategy`'s) to
    `model`, built on the CPU (or, for fsdp, on the meta device: see kiln.parallel.materialize). Returns what to
    train."""
    tcfg, d = cfg.train, cfg.dist
    if n_params is None:
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    strategy = strategy or choose_strategy(cfg, m, n_params, log)
    if tcfg.offload != "none" and strategy != "single":
        raise ConfigError(f"train.offload={tcfg.offload} runs in one process on one GPU; this run has {m.world} "
                          f"processes ({strategy}): start one process, or remove train.offload and let FSDP shard "
                          "the state (dist.cpu_offload offloads it under FSDP)")
    if d.expert_parallel > 1:
        from kiln.parallel.experts import check

        check(cfg, m, strategy)
        e = cfg.model.moe.n_experts
        log(f"expert parallelism: each of the {m.world} processes keeps {e // m.world} of the {e} experts of every "
            "mixture-of-experts layer, and the tokens go to them by all-to-all (dist.expert_parallel)")
    if tcfg.fp8.enabled:  # the blocks' linear layers in float8 (kiln.parallel.float8), before AC wraps them
        from kiln.parallel.float8 import convert

        convert(model, tcfg.fp8, fsdp=strategy == "fsdp", log=log)
    # expert parallelism under full checkpointing keeps its dispatch's output (the layer's expert rows, 2 bytes a
    # routed row's element in bf16): recomputing it would repeat the layer's all-to-alls and host read
    layered = strategy == "single" and tcfg.offload == "optimizer" and offload_layers.supports(model)
    if layered and tcfg.activation_checkpointing != "none":  # kiln.parallel.offload_layers
        log(f"train.activation_checkpointing={tcfg.activation_checkpointing} is not applied: train.offload runs each "
            "layer's forward pass again in its backward pass itself (full checkpointing, layer by layer)")
    apply_ac(model, "none" if layered else tcfg.activation_checkpointing,
             keep=frozenset({DISPATCH_OP}) if d.expert_parallel > 1 and strategy == "fsdp" else frozenset())
    if tcfg.compile:
        compile_cache.use(tcfg.compile_cache)
        # under DDP a whole-model graph is split by torch's compiler at DDP's bucket boundaries (of 1 MB at
        # least), so each bucket's all-reduce still overlaps the backward pass (1% faster than per block at 124m)
        per_block = None  # why a whole-model graph cannot be kept
        if strategy == "fsdp":
            per_block = "each block is gathered and resharded on its own"
        elif strategy == "ddp" and d.bucket_mb < 1:
            per_block = f"a whole-model graph needs dist.bucket_mb of 1 or more, not {d.bucket_mb}"
        elif layered:
            per_block = "train.offload runs the model a layer at a time"
        scope = tcfg.compile_scope
        if scope == "model" and per_block:
            log(f"train.compile_scope=model is compiled per block under {strategy} ({per_block})")
            scope = "blocks"
        apply_compile(model, scope=scope)  # in place: state-dict keys stay the same
    loss_kernel.install(tcfg.cross_entropy_kernel, m.device, log)  # after compile: Triton's before torch's
    if strategy == "single" and tcfg.offload == "optimizer":  # fp32 masters stay on the host (kiln.parallel.offload)
        from kiln.parallel.offload import place_model

        return place_model(model, m.device, torch.bfloat16 if uses_bf16(cfg, m.device) else torch.float32)
    if strategy == "single":
        return model.to(m.device)
    if strategy == "ddp":
        if d.sharding != "full" or d.cpu_offload:
            log("dist.sharding and dist.cpu_offload apply to fsdp only; ignored under ddp")
        model.to(m.device)
        ids = [m.device.index] if m.device.type == "cuda" else None
        # frozen parameters (a LoRA base, read from init_from by every rank) are not broadcast from rank 0: the same
        # already, gigabytes for an 8B base, and an NF4 one (QLoRA) would come back quantized a second time
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            DDP._set_params_and_buffers_to_ignore_for_model(model, frozen)
        with warnings.catch_warnings():  # broadcast_buffers is deprecated in name only: it is still the way
            warnings.simplefilter("ignore", FutureWarning)  # to skip syncing buffers
            # rope tables are rebuilt identically on every rank: no buffer broadcast in each forward
            return DDP(model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True,
                       bucket_cap_mb=d.bucket_mb)
    return _shard(model, cfg, m)


def _shard(model: nn.Module, cfg: RunConfig, m: Mesh) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    d = cfg.dist
    if d.sharding == "hybrid":
        mesh = m.hybrid_mesh(d.replicas)
    else:
        if d.replicas is not None:
            raise ConfigError("dist.replicas applies to dist.sharding=hybrid only; remove it or set the sharding")
        mesh = m.mesh
    mp = MixedPrecisionPolicy()
    if uses_bf16(cfg, m.device):  # bf16 compute copies of the fp32 master weights; gradients reduced in fp32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32 if d.reduce_fp32 else torch.bfloat16)
    offload = CPUOffloadPolicy(pin_memory=m.device.type == "cuda") if d.cpu_offload else OffloadPolicy()
    reshard = d.sharding != "grad_op"
    experts = None  # expert parallelism: each process's own experts, which FSDP leaves alone
    if d.expert_parallel > 1:
        from kiln.parallel.experts import shard_experts

        experts = shard_experts(model, m)
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        # the last block's backward comes right after its forward: resharding it would only regather it
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard and i < n - 1,
                    ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard,
                ignored_params=experts)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and one-process models are their own)."""
    return getattr(model, "module", model)


def strategy_of(model: nn.Module) -> str:
    """'ddp', 'fsdp' or 'single': how `parallelize` wrapped the model (asked every micro-batch: no imports here)."""
    return "ddp" if isinstance(model, DDP) else "fsdp" if isinstance(model, FSDPModule) else "single"


@contextlib.contextmanager
def grad_sync(model: nn.Module, sync: bool, every_microbatch: bool = False) -> Iterator[None]:
    """Around one micro-batch's forward and backward: `sync=False` (every micro-batch but the last of an
    accumulation) keeps the gradients local, with no collective; the last one reduces them all.

    `every_microbatch` (dist.reduce_every_microbatch): under FSDP every micro-batch reduce-scatters its gradients
    into the sharded ones instead, so FSDP2 keeps no unsharded gradient between micro-batches; hybrid sharding
    holds each micro-batch's reduce-scattered shard until the last one all-reduces the sum over the replicas.
    DDP and one process are unaffected: their gradients are full-size either way."""
    kind = strategy_of(model)
    if kind == "ddp" and not sync:
        with model.no_sync():
            yield
        return
    if kind == "fsdp":
        model.set_requires_gradient_sync(sync or every_microbatch)
        if every_microbatch:
            model.set_requires_all_reduce(sync)  # HSDP only: its replicas' all-reduce once a step
    yield


def drop_unreduced_grads(model: nn.Module) -> None:
    """After a forward or backward pass that failed (out of memory), or micro-batches never followed by a step's
    last: drop the gradients FSDP2 holds outside the parameters' own, each parameter's unsharded gradient kept
    with the sync off (or left by a block whose backward was cut short) and, under hybrid sharding with
    `grad_sync(every_microbatch=True)`, the reduce-scattered sums waiting for their all-reduce. Left there, the
    next backward pass would add them to its own, and they would keep their memory. The sharded gradients already
    reduced are the parameters' own, which `optimizer.zero_grad` drops; a no-op for DDP and one process."""
    if strategy_of(model) != "fsdp":
        return
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before per-module lists of groups
            groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        for group in groups:
            if getattr(group, "_partial_reduce_output", None) is not None:
                group._partial_reduce_output = None
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over every shard); returns the norm before clipping, a plain tensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding each shard's partial norm
        norm = norm.full_tensor()
    nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def optimizer_device(cfg: RunConfig, device: torch.device, model: nn.Module) -> torch.device:
    """Where the optimizer's state lives: the CPU under FSDP with cpu_offload, else the training device."""
    return torch.device("cpu") if cfg.dist.cpu_offload and strategy_of(model) == "fsdp" else device


def full_model(model: nn.Module, cfg: RunConfig, m: Mesh) -> nn.Module | None:
    """A plain model holding the full weights, on rank 0 (None on the others); every rank must call it.

    One process and DDP give their own module; FSDP gathers the shards into a new module on rank 0's
    device (the final safetensors file and the sample are made from it)."""
    kind = strategy_of(model)
    if kind != "fsdp":
        return unwrap(model) if m.rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if m.rank != 0:
        return None
    if cfg.model.hf_class == "auto":  # a transformers model (kiln.model.hf_auto): built whole on the CPU
        from kiln.model.hf_auto import build_auto

        plain = build_auto(cfg.model, cfg.lora, weights=False)
        missing, unexpected = plain.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"gathered state does not match the model: missing {missing}, unexpected {unexpected}")
        return plain.to(m.device)
    from kiln.model.llama import Transformer
    from kiln.model.lora import apply_lora
    from kiln.model.quant import dequantized

    state = {k: dequantized(v) for k, v in state.items()}  # QLoRA: an NF4 base's values, in a plain model
    with torch.device("meta"):
        plain = apply_lora(Transformer(cfg.model), cfg.lora)  # LoRA: the adapters' keys too
    plain.to_empty(device="cpu")
    plain.init_buffers()  # re-ties embeddings and rebuilds the rope tables; the weights come next
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and cfg.model.tie_embeddings)]:
        raise RuntimeError(f"gathered state does not match the model: missing {missing}, unexpected {unexpected}")
    return plain.to(m.device)


def reduce_mean(values: torch.Tensor, m: Mesh) -> torch.Tensor:
    """Mean over every rank of a small tensor (a no-op in a one-process run)."""
    if not m.distributed:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / m.world
