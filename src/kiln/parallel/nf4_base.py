"""A QLoRA run's base, built on its device a block at a time and quantized to NF4 as each block arrives.

    model = nf4_model(cfg, device, weights_from=cfg.model.init_from)   # then apply_lora, parallelize

The model is built on the meta device (no memory). The embeddings, the final norm and lm_head are given
memory on the device in lora.base_dtype and filled; then each block in turn: its parameters get memory on
the device, its weights are read from the safetensors files (each tensor alone: no file is read whole) or
drawn, and its linear layers are quantized there (kiln.model.quant) before the next block comes. The device
never holds more than the quantized blocks, the embeddings and one block in full: an 8B base arrives in
about 6 GB, not its 16 GB of bf16 (and the host holds one tensor at a time, not the model).

Without `weights_from` (a QLoRA run always has one; benchmarks use a random base) each parameter is drawn
on the device as `Transformer.init_order` says, from its own generator seeded with (`seed`, its name): the
same base on any device of one type. `init` false leaves the values as they come.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import torch
from torch import nn

from kiln.config import RunConfig
from kiln.errors import StateError
from kiln.model.llama import Transformer
from kiln.model.lora import BASE_DTYPES
from kiln.model.quant import quantize_block


class WeightReader:
    """The tensors of a Hugging Face model directory by name, each read alone from its safetensors file
    (pickled weights, where allowed, are read whole once)."""

    def __init__(self, path: str | Path, allow_pickle: bool = False):
        from kiln.model.hf_import import read_hf_state_dict, weight_files

        self.path, self.files = path, weight_files(path, allow_pickle)
        self.where: dict[str, Path] = {}
        self.whole: dict[str, torch.Tensor] | None = None
        if self.files[0].suffix != ".safetensors":
            self.whole = read_hf_state_dict(path, allow_pickle)
            return
        from safetensors import safe_open

        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    self.where.update((k, file) for k in f.keys())
            except Exception as e:  # safetensors raises its own types on damaged files
                raise StateError(f"{file} cannot be read ({e}); copy it again from its source") from None

    def names(self) -> set[str]:
        return set(self.whole) if self.whole is not None else set(self.where)

    def get(self, name: str) -> torch.Tensor:
        if self.whole is not None:
            return self.whole[name]
        from safetensors import safe_open

        file = self.where[name]
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise StateError(f"{file} cannot be read ({e}); copy it again from its source") from None


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


@torch.no_grad()
def nf4_model(cfg: RunConfig, device: torch.device | str, weights_from: str | None = None, init: bool = True,
              seed: int | None = None) -> Transformer:
    """The run's Transformer on `device`: block linear layers in NF4 and frozen, every other parameter in
    lora.base_dtype (frozen too: apply_lora adds the adapters). See the module doc."""
    device = torch.device(device)
    dtype = BASE_DTYPES[cfg.lora.base_dtype]
    with torch.device("meta"):
        model = Transformer(cfg.model)
    reader = WeightReader(weights_from, cfg.model.allow_pickle) if weights_from is not None else None
    if reader is not None:
        _check_names(reader, model, weights_from)
    names = {id(p): n for n, p in model.named_parameters()}
    inits = {names[id(p)]: init for p, init in model.init_order()}  # by name: to_empty makes new tensors
    gen = torch.Generator(device)
    seed = cfg.train.seed if seed is None else seed

    def fill(module: nn.Module, prefix: str) -> None:
        module.to_empty(device=device)
        for name, p in module.named_parameters(prefix=prefix):
            p.requires_grad_(False)
            if reader is not None:
                _copy(p, reader.get(_hf_name(name)), weights_from, name)
            elif init:
                _draw(p, name, inits[name], gen, seed)
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)

    # the parameters outside the blocks first (a tied lm_head is the embedding: init_buffers ties it again)
    for name, module in model.named_children():
        if name != "layers" and not (name == "lm_head" and cfg.model.tie_embeddings):
            fill(module, name)
    for i, block in enumerate(model.layers):
        fill(block, f"layers.{i}")
        quantize_block(block, dtype, f"layers.{i}")
    model.to_empty(device=device, recurse=False)  # the rope tables (the model's own buffers)
    model.init_buffers()  # re-ties the embeddings, builds the rope tables
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _draw(p: torch.Tensor, name: str, init, gen: torch.Generator, seed: int) -> None:
    """`p` drawn as `init` does, from a generator seeded with (`seed`, the parameter's name)."""
    full = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    if "generator" in inspect.signature(init).parameters:  # the random ones; ones_ / zeros_ draw nothing
        digest = hashlib.blake2b(f"kiln-nf4-base:{seed}:{name}".encode(), digest_size=8).digest()
        gen.manual_seed(int.from_bytes(digest, "little") >> 1)
        init(full, generator=gen)
    else:
        init(full)
    p.copy_(full)


def _check_names(reader: WeightReader, model: nn.Module, path) -> None:
    wanted = {_hf_name(n) for n, _ in model.named_parameters()}  # a tied lm_head is listed once (the embedding)
    found = {k for k in reader.names() if not k.endswith("rotary_emb.inv_freq")}
    if model.cfg.tie_embeddings:
        found.discard("lm_head.weight")
    missing, unexpected = sorted(wanted - found), sorted(found - wanted)
    if missing or unexpected:
        raise StateError(f"the weights in {path} do not fit its config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def _copy(param: torch.Tensor, source: torch.Tensor, path, name: str) -> None:
    if tuple(source.shape) != tuple(param.shape):
        raise StateError(f"the weights in {path} do not fit its config.json: {_hf_name(name)} has shape "
                         f"{list(source.shape)}, the model expects {list(param.shape)}")
    param.copy_(source)
