"""Build the model a run trains, with no process holding more of it than it needs.

    model = build_model(cfg, mesh, n_params, log, weights_from=cfg.model.init_from)  # AC, compile, DDP/FSDP applied

FSDP: the model is built on the meta device (shapes only, no memory), checkpointed, compiled and
sharded there, then `to_empty` gives each process its shard on its device, uninitialised. Each
parameter is then drawn full-size, one at a time, and the process keeps its rows; every process draws
the same full tensor, so the weights do not depend on the world size, and no process holds more than
its shards plus one full parameter (the embedding table, the largest: 2 GB in fp32 for Llama-3-8B).
Where it is drawn depends on the device the run trains on:

- CPU: from the global generator after torch.manual_seed(train.seed), in the order of a one-process run
  (`Transformer.init_order`): the weights equal a one-process run's bit for bit.
- CUDA: on the GPU, each parameter from its own `torch.Generator(device)` seeded from (train.seed, its
  place in `init_order`) (`param_seed`). The host drawing an 8B model (minutes per rank, with the ranks
  sharing the node's cores, at every start and restart) becomes a GPU drawing it (about a second). The
  seed per parameter makes each parameter a function of the seed, its place and its shape alone: not of
  the world size, the sharding or the parameters drawn before it. The values differ from the CPU ones
  (the CPU and CUDA generators are different algorithms), and a CUDA draw's layout follows torch's
  launch grid, which can differ between GPU models: the same config starts from the same weights on
  any number of GPUs of one model, not on a CPU. One process and DDP (below) keep the CPU draw.

With `weights_from` (model.init_from on a fresh start) no random init happens: each process reads its
rows of each tensor straight from the safetensors files.

One process and DDP hold the whole model anyway: it is built on the CPU as before; with `weights_from`
it is built on the meta device and materialised empty, so the random init it would overwrite is skipped.
A resume (`init=False`) skips it under every strategy: the checkpoint overwrites every parameter.
Rope tables are buffers, not parameters: `to_empty` leaves them garbage and `init_buffers` rebuilds them.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kiln.config import RunConfig
from kiln.errors import StateError
from kiln.model import hf_nemotron_h
from kiln.model.hf_experts import expert_slot, renamed, stack_experts
from kiln.model.hf_import import load_init_weights, read_hf_state_dict, weight_files
from kiln.model.llama import Transformer
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import choose_strategy, parallelize


def build_model(cfg: RunConfig, m: Mesh, n_params: int, log: Callable[[str], None] = print,
                weights_from: str | None = None, init: bool = True,
                adapt: Callable[[nn.Module], int] | None = None) -> nn.Module:
    """The model `cfg` describes, parallelized for `m` (see `parallelize`), with the seeded random init
    of a one-process run, or the weights of the Hugging Face directory `weights_from`, or (`init`
    false: a resume, whose checkpoint brings every weight) uninitialised parameters.

    `adapt` (LoRA) changes the plain, loaded model before it is parallelized and returns the parameter count
    the strategy weighs; the model is then built whole on the CPU under every strategy (its base is frozen,
    in bf16 by default, and FSDP shards it from there).
    Call after torch.manual_seed(train.seed): on the CPU the random init draws from the global generator
    (on CUDA, FSDP draws on the GPU from generators seeded with train.seed: see the module doc)."""
    if adapt is not None and cfg.lora.quantize_base == "nf4":  # QLoRA: built on the device, quantized per block
        from kiln.parallel.nf4_base import nf4_model

        model = nf4_model(cfg, m.device, weights_from, init)
        n = adapt(model)
        strategy = choose_strategy(cfg, m, n, log)
        if strategy == "fsdp":
            _check_nf4_shards(model, m.world)
        return parallelize(model, cfg, m, n, log, strategy=strategy)
    if adapt is not None:
        model = _plain(cfg, weights_from, init)
        return parallelize(model, cfg, m, adapt(model), log)
    strategy = choose_strategy(cfg, m, n_params, log)
    if strategy != "fsdp":
        return parallelize(_plain(cfg, weights_from, init), cfg, m, n_params, log, strategy=strategy)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = parallelize(model, cfg, m, n_params, log, strategy=strategy)
    materialize(model, m, cpu_offload=cfg.dist.cpu_offload)
    if weights_from is not None:
        load_shards(model, weights_from, cfg.model.allow_pickle, cfg.model.tie_embeddings)
    elif init:
        init_shards(model, m.device, cfg.train.seed)
    return model


def _check_nf4_shards(model: nn.Module, world: int) -> None:
    """ConfigError, before any sharding, for a QLoRA base FSDP2 cannot split over `world` processes."""
    from kiln.errors import ConfigError
    from kiln.model.quant import unshardable

    bad = unshardable(model, world)
    if bad:
        raise ConfigError(f"lora.quantize_base=nf4 under FSDP over {world} processes: {', '.join(bad[:3])}"
                          f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''} cannot be split into {world} equal "
                          "shards (their rows, 4-bit codes and scales must each divide by it). Set dist.strategy=ddp "
                          "(the adapters are small; each process then holds the whole 4-bit base), or use fewer "
                          "processes")


def _plain(cfg: RunConfig, weights_from: str | None, init: bool) -> nn.Module:
    """The whole model on the CPU: seeded random init, or (with `weights_from`, or `init` false) built without
    it and loaded, or left for a checkpoint to fill."""
    if weights_from is None and init:
        return Transformer(cfg.model)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device="cpu")
    model.init_buffers()
    if weights_from is not None:
        load_init_weights(model, cfg.model.model_copy(update={"init_from": weights_from}))
    return model


@torch.no_grad()
def materialize(model: nn.Module, m: Mesh, cpu_offload: bool = False) -> None:
    """Give the meta-device, sharded `model` real (uninitialised) memory: parameters on the device (the
    CPU with cpu_offload, where FSDP2 keeps them), buffers on the device; rebuild ties and rope tables."""
    model.to_empty(device="cpu" if cpu_offload else m.device)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != m.device:
                module._buffers[name] = buf.to(m.device)
    model.init_buffers()


def local_slices(param: torch.Tensor) -> tuple[slice, ...]:
    """Which part of the full tensor this process holds of `param` (a DTensor shard, or a plain tensor: all)."""
    if not hasattr(param, "device_mesh"):
        return tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


@torch.no_grad()
def init_shards(model: nn.Module, device: torch.device | str = "cpu", seed: int | None = None) -> None:
    """Initialise `model`'s (sharded) parameters as the module doc says: on the CPU from the global generator,
    in one-process order; on any other device (CUDA) on that device, one generator per parameter from `seed`."""
    device = torch.device(device)
    if device.type == "cpu":
        init_from_global_stream(model)
    else:
        init_seeded(model, device, torch.initial_seed() if seed is None else seed)


@torch.no_grad()
def init_from_global_stream(model: nn.Module) -> None:
    """The one-process init, parameter by parameter: each drawn full-size on the CPU from the global
    generator (every process draws the same numbers), this process's rows copied to its shard."""
    for param, init in model.init_order():
        full = torch.empty(param.shape, dtype=param.dtype)
        init(full)
        _local(param).copy_(full[local_slices(param)])
        del full


def param_seed(seed: int, index: int) -> int:
    """The seed of the parameter at `index` of `init_order` in a run seeded with `seed` (63 bits, well mixed)."""
    digest = hashlib.blake2b(f"kiln-init:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def init_seeded(model: nn.Module, device: torch.device | str, seed: int) -> None:
    """Each parameter of `init_order` drawn full-size on `device` from a generator seeded with `param_seed`,
    this process's rows copied to its shard (wherever it lives: the device, or the CPU under cpu_offload),
    the rest freed before the next: the device holds one full parameter at a time. Equal on any world size."""
    device = torch.device(device)
    gen = torch.Generator(device)
    for index, (param, init) in enumerate(model.init_order()):
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        if "generator" in inspect.signature(init).parameters:  # the random ones; ones_ / zeros_ draw nothing
            gen.manual_seed(param_seed(seed, index))
            init(full, generator=gen)
        else:
            init(full)
        _local(param).copy_(full[local_slices(param)])
        del full
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the cached full-size blocks go back: training's memory is what is left


def _hf_name(name: str, hybrid: bool) -> str:
    if name.startswith("lm_head."):
        return name
    return f"model.{hf_nemotron_h.TOP_LEVEL.get(name, name) if hybrid else name}"


@torch.no_grad()
def load_shards(model: nn.Module, path: str | Path, allow_pickle: bool, tied: bool) -> None:
    """Each parameter's rows of this process, read from the safetensors files of `path` (a Hugging Face
    model directory) without loading the rest. Pickled weights are read whole, then sliced. A mixture of
    experts' per-expert tensors each fill their rows of the stacked parameter (kiln.model.hf_experts)."""
    files = weight_files(path, allow_pickle)
    params = dict(model.named_parameters())  # a tied lm_head is the embedding: listed once
    if tied:
        params.pop("lm_head.weight", None)
    hybrid = hf_nemotron_h.is_hybrid_state(params)
    wanted = {_hf_name(n, hybrid): n for n in params}
    if files[0].suffix != ".safetensors":
        state = stack_experts({hf_nemotron_h.model_key(k): v for k, v in read_hf_state_dict(path, allow_pickle).items()
                               if not k.startswith("mtp.")})
        _check_names(path, wanted, state.keys(), tied)
        for hf, name in wanted.items():
            _copy(params[name], state[hf], path, hf)
        return
    from safetensors import safe_open

    found, experts = set(), {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
                for key in keys:
                    if key.startswith("mtp."):  # Nemotron-H's multi-token-prediction heads: not in the model
                        continue
                    hf = hf_nemotron_h.model_key(key)  # Nemotron-H's files name the decoder backbone.
                    slot = expert_slot(hf)
                    if slot is not None and slot[0] in wanted:
                        _copy_expert(params[wanted[slot[0]]], f.get_slice(key), slot[1], slot[2], path, key)
                        experts.setdefault(slot[0], set()).add(slot[1:])
                        continue
                    found.add(renamed(hf))  # Mixtral's block_sparse_moe.gate is Kiln's mlp.gate
                    if renamed(hf) in wanted:
                        _copy(params[wanted[renamed(hf)]], f.get_slice(key), path, key)
        except StateError:
            raise
        except Exception as e:  # safetensors raises its own types on damaged files
            raise StateError(f"{file} cannot be read ({e}); copy it again from its source") from None
    for name, parts in experts.items():  # a stacked parameter is read when every expert's every part was
        if len(parts) == params[wanted[name]].shape[0] * (1 if name.endswith("down_proj") else 2):
            found.add(name)
    _check_names(path, wanted, found, tied)


def _check_names(path, wanted: dict[str, str], found, tied: bool) -> None:
    found = {k for k in found if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        found.discard("lm_head.weight")
    missing, unexpected = sorted(set(wanted) - found), sorted(found - set(wanted))
    if missing or unexpected:
        raise StateError(f"the weights in {path} do not fit its config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def _copy_expert(param: torch.Tensor, source, index: int, part: str, path, hf: str) -> None:
    """Expert `index`'s `part` (gate, up: halves of gate_up_proj's rows; down) into this process's rows of the
    stacked `param` (E, rows, cols), where it holds any of them."""
    n, rows, cols = param.shape
    lo_row, hi_row = {"gate": (0, rows // 2), "up": (rows // 2, rows), "down": (0, rows)}[part]
    shape = tuple(source.get_shape())
    if index >= n or shape != (hi_row - lo_row, cols):
        raise StateError(f"the weights in {path} do not fit its config.json: {hf} has shape {list(shape)}, the model "
                         f"expects {[hi_row - lo_row, cols]} for one of its {n} experts")
    s_exp, s_row, s_col = local_slices(param)
    lo, hi = max(s_row.start, lo_row), min(s_row.stop, hi_row)
    if not s_exp.start <= index < s_exp.stop or lo >= hi:
        return
    _local(param)[index - s_exp.start, lo - s_row.start:hi - s_row.start].copy_(
        source[lo - lo_row:hi - lo_row, s_col])


def _copy(param: torch.Tensor, source, path, hf: str) -> None:
    shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
    if shape != tuple(param.shape):
        raise StateError(f"the weights in {path} do not fit its config.json: {hf} has shape {list(shape)}, "
                         f"the model expects {list(param.shape)}")
    part = source[local_slices(param)]
    _local(param).copy_(part)
