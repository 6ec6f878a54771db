"""Float8 training (train.fp8) applied to a plain model from outside, before AC, compile and FSDP2:

    convert(model, cfg.train.fp8, fsdp=True)   # the blocks' nn.Linear layers become torchao's Float8Linear
    scale_after_step(optimizer, model)          # FSDP2 + tensorwise: every float8 weight's scale in one all-reduce

A converted layer keeps its parameter (same name, same fp32 tensor: state-dict keys, checkpoints and exports do
not change) and casts it and its input to float8 inside its forward pass, with a scale per tensor (tensorwise) or
per row (rowwise); the gradient's products run in float8 too. Kept in bf16 (see `Fp8Config`): everything outside
`model.layers` (the embeddings and the output layer lm_head), routers, and layers with a size not a multiple of 16.

torchao is imported here only, when a run asks for fp8 (pip install 'kiln[fp8]').
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.config.fp8 import Fp8Config
from kiln.errors import ConfigError

FP8_CAPABILITY = (8, 9)  # Ada (L4, L40S), Hopper (H100, H200), Blackwell: float8 tensor cores
ROUTER_NAMES = ("router", "gate")  # a mixture of experts' router: tiny, and its top-k choice is fragile


def device_problem(device: torch.device | str) -> str | None:
    """Why `device` cannot train in float8 (None if it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"train.fp8.enabled needs a CUDA GPU with float8 tensor cores (compute capability 8.9 or more: "
                f"H100, H200, L4, L40S, B200); this run trains on the {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"train.fp8.enabled needs a GPU with float8 tensor cores (compute capability 8.9 or more: H100, "
                f"H200, L4, L40S, B200); {device} is a {name}, compute capability {cap[0]}.{cap[1]}")
    return None


def check_device(device: torch.device | str) -> None:
    """ConfigError unless `device` has float8 tensor cores and torchao is installed (at the start of an fp8 run,
    before any data work)."""
    problem = device_problem(device)
    if problem is not None:
        raise ConfigError(f"{problem}. Set train.fp8.enabled=false to train in bf16")
    _torchao_float8()


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError("train.fp8.enabled needs torchao (its float8 training): pip install 'kiln[fp8]', "
                          "or set train.fp8.enabled=false") from None
    return float8


def keeps_bf16(name: str, linear: nn.Linear, skip: list[str] | tuple[str, ...] = ()) -> str | None:
    """Why the block's linear layer `name` (its state-dict prefix) stays in bf16, or None to convert it."""
    if name.rsplit(".", 1)[-1] in ROUTER_NAMES:
        return "a router"
    if linear.in_features % 16 or linear.out_features % 16:
        return f"{linear.in_features} x {linear.out_features} is not a multiple of 16"
    hit = next((s for s in skip if s in name), None)
    return f"train.fp8.skip has '{hit}'" if hit is not None else None


def layer_config(fp8: Fp8Config, fsdp: bool, emulate: bool = False):
    """torchao's Float8LinearConfig for `fp8` (float8 all-gather under FSDP with the tensorwise recipe)."""
    float8 = _torchao_float8()
    if fp8.recipe == "tensorwise":
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp and fp8.all_gather, emulate=emulate)
    base = float8.Float8LinearConfig.from_recipe_name(fp8.recipe)
    if not emulate:
        return base
    import dataclasses

    return dataclasses.replace(base, emulate=True)


def convert(model: nn.Module, fp8: Fp8Config, fsdp: bool = False, log: Callable[[str], None] | None = None,
            emulate: bool = False) -> list[str]:
    """Swap the linear layers of `model.layers` for float8 ones, in place (call before AC, compile and
    sharding); returns the names converted. `emulate` computes the float8 products in high precision from the
    float8 values (any device: tests on the CPU)."""
    float8 = _torchao_float8()
    config = layer_config(fp8, fsdp, emulate)
    converted, kept = [], {}
    for i, block in enumerate(model.layers):
        def wanted(module: nn.Module, fqn: str, i=i) -> bool:
            if not isinstance(module, nn.Linear):
                return False
            name = f"layers.{i}.{fqn}"
            why = keeps_bf16(name, module, fp8.skip)
            if why is None:
                converted.append(name)
            else:
                kept[name] = why
            return why is None

        float8.convert_to_float8_training(block, module_filter_fn=wanted, config=config)
    if config.enable_fsdp_float8_all_gather:
        from torchao.float8.float8_linear import Float8Linear

        for module in model.layers.modules():
            if isinstance(module, Float8Linear):
                module.register_state_dict_post_hook(_plain_weight)
    if log is not None:
        gathered = " (weights gathered in float8)" if config.enable_fsdp_float8_all_gather else ""
        line = f"train.fp8: {len(converted)} linear layers in float8, {fp8.recipe} scaling{gathered}"
        if kept:
            reasons = sorted({f"{name.split('.', 2)[-1]}: {why}" for name, why in kept.items()})
            line += f"; kept in bf16 besides lm_head and the embeddings: {'; '.join(reasons)}"
        if not converted:
            line = "warning: " + line + " -- no layer is float8: this run trains in bf16"
        log(line)
    return converted


def _plain_weight(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a float8 layer whose weight FSDP gathers in float8: the saved weight is the DTensor of
    its plain fp32 shard (the same memory), not of torchao's wrapper, so a checkpoint reads without torchao."""
    key = prefix + "weight"
    weight = state.get(key)
    inner = getattr(getattr(weight, "_local_tensor", None), "_tensor", None)
    if inner is not None:
        from torch.distributed.tensor import DTensor

        state[key] = DTensor.from_local(inner, weight.device_mesh, weight.placements, run_check=False,
                                        shape=weight.shape, stride=weight.stride())


def to_plain(model: nn.Module) -> int:
    """Swap every float8 layer of `model` back for an nn.Linear holding the same parameters, in place (a model
    not sharded by FSDP, after training: its sample and save are a bf16 run's; rowwise float8 products cannot
    give the fp32 outputs of a generation outside autocast). Returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Float8Linear":
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
                swapped += 1
    return swapped


def gathers_float8(model: nn.Module) -> bool:
    """Whether any of `model`'s float8 weights is gathered in float8 under FSDP2 (their scales then come from
    `precompute_scales` after each optimizer step)."""
    return any(type(getattr(m, "weight", None)).__name__ == "DTensor"
               and type(m.weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
               for m in model.modules())


def precompute_scales(model: nn.Module) -> None:
    """The float8 scale of every weight gathered in float8, in one all-reduce (every rank calls it)."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def forget_scales(model: nn.Module) -> None:
    """Drop the precomputed scales: weights just loaded (a resume, a rollback) scale themselves at their next
    gather, as on the first step of a run."""
    for m in model.modules():
        local = getattr(getattr(m, "weight", None), "_local_tensor", None)
        if hasattr(local, "_precomputed_scale"):
            local._precomputed_scale = None


def scale_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Under FSDP2 with float8 gathers: after each optimizer step, the new weights' scales are computed for all
    at once (one all-reduce, not one per weight at its gather), and a load of the model's weights drops them.
    Returns whether it applies to `model`."""
    if not gathers_float8(model):
        return False
    optimizer.register_step_post_hook(lambda *_: precompute_scales(model))
    model.register_load_state_dict_post_hook(lambda module, _: forget_scales(module))
    return True
