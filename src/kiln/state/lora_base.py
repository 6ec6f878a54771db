"""The frozen base of a LoRA run: referenced by hash, never copied into a checkpoint.

A LoRA run's checkpoints hold the adapters (and their optimizer moments) only; the base weights come
from model.init_from at every start and resume. Its identity is the sha256 of its weight files
(`base_hash`), recorded in each checkpoint's fingerprints under "base_model"; a resume or an export
whose init_from hashes differently is refused (`check_base`): adapters trained on one base mean
nothing on another.

Merged, a LoRA run is its adapters on that base as the user brought it (`merged_model`): the weights read
again from model.init_from at their stored precision, not the training copy (bf16 under the default
lora.base_dtype, which would round even the weights no adapter touches). The final model/ and an export of
any checkpoint are merged the same way, so one step gives one model.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import StateError

if TYPE_CHECKING:
    import torch

    from kiln.config import LoraConfig, ModelConfig
from kiln.files import sha256_file

KEY = "base_model"  # under a checkpoint's fingerprints


def base_hash(init_from: str | Path, allow_pickle: bool = False) -> str:
    """sha256 over the (name, sha256) of each weight file of a Hugging Face model directory, in order
    (files hashed in parallel: hashlib releases the GIL)."""
    from kiln.model.hf_import import weight_files

    files = weight_files(init_from, allow_pickle)
    with ThreadPoolExecutor(max(1, min(8, len(files)))) as pool:
        digests = list(pool.map(sha256_file, files))
    h = hashlib.sha256()
    for f, d in zip(files, digests):
        h.update(f"{f.name} {d}\n".encode())
    return h.hexdigest()


def check_base(saved: dict[str, Any], current: str | None, where: str, init_from: str | None) -> None:
    """StateError unless the base recorded in `saved` (a checkpoint's fingerprints) is `current`."""
    recorded = saved.get(KEY)
    if recorded is None and current is None:
        return
    if recorded is None:
        raise StateError(f"{where} was saved without LoRA (its model part holds every weight), but lora.rank is "
                         "set now: resume it with lora.rank=0, or start a LoRA run with --resume never")
    if current is None:
        raise StateError(f"{where} holds LoRA adapters (lora.rank was set), but lora.rank is 0 now: set the saved "
                         "lora settings again (see `kiln inspect`)")
    if recorded != current:
        raise StateError(f"{where} holds LoRA adapters trained on a base model whose weights hash to "
                         f"{recorded[:16]}..., but model.init_from={init_from} hashes to {current[:16]}...: the "
                         "base changed. Point model.init_from at the base the run started from (adapters mean "
                         "nothing on another base), or start a new run with --resume never")


def _nf4_base(lora: LoraConfig):
    """(whether the layer at a state-dict prefix is quantized, a weight's NF4 round trip in fp32 on the CPU) of a
    QLoRA run (lora.quantize_base=nf4); nothing is quantized otherwise. Quantized where the run trains (a GPU
    when there is one), as training did: each weight comes back as the run's base held it."""
    import torch

    if lora.quantize_base != "nf4":
        return (lambda prefix: False), None
    from kiln.model.lora import BASE_DTYPES
    from kiln.model.quant import LAYERS, round_trip

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = BASE_DTYPES[lora.base_dtype]

    def quantized(prefix: str) -> bool:
        return prefix.startswith("layers.") and prefix.split(".", 2)[-1] in LAYERS

    def nf4_round_trip(value: torch.Tensor, key: str) -> torch.Tensor:
        return round_trip(value.to(device), dtype, key).to("cpu", torch.float32)

    return quantized, nf4_round_trip


def merged_model(cfg: ModelConfig, lora: LoraConfig, adapters: dict[str, torch.Tensor]):
    """A plain Transformer (CPU, fp32) of `adapters` (a LoRA model's adapter tensors) merged onto the base of
    cfg.init_from as stored: W + (alpha / r) B A, every sum in fp32. QLoRA (lora.quantize_base=nf4): onto the
    dequantized base, the weights the adapters were trained with; embeddings, norms and lm_head as stored."""
    import torch

    from kiln.model.hf import from_hf_state_dict
    from kiln.model.hf_import import read_hf_state_dict
    from kiln.model.llama import Transformer
    from kiln.model.lora_experts import merge_experts, stacked_adapter

    base = from_hf_state_dict(read_hf_state_dict(cfg.init_from, cfg.allow_pickle), cfg.tie_embeddings)
    scale = lora.alpha / lora.rank
    quantized, nf4_round_trip = _nf4_base(lora)
    state: dict[str, torch.Tensor] = {}
    for key in list(base):  # one tensor at a time, the stored one dropped as its fp32 copy is made: the merge
        value = base.pop(key)  # peaks near the model's fp32 size, not that plus the stored base
        if cfg.tie_embeddings and key == "lm_head.weight":  # the embedding's own tensor, tied again below
            continue
        state[key] = value.float() if value.is_floating_point() else value
        prefix = key.removesuffix(".weight")
        if quantized(prefix):  # QLoRA: the base weight the adapters were trained on
            state[key] = nf4_round_trip(value, key)
        if f"{prefix}.lora_A.weight" in adapters:
            a = adapters[f"{prefix}.lora_A.weight"].detach().to("cpu", torch.float32)
            b = adapters[f"{prefix}.lora_B.weight"].detach().to("cpu", torch.float32)
            state[key] = state[key] + scale * (b @ a)
    stacked = {k: v.detach().to("cpu") for k, v in adapters.items() if stacked_adapter(k) is not None}
    if stacked:  # a mixture of experts' per-expert adapters, into their experts' rows (kiln.model.lora_experts)
        state = merge_experts({**state, **stacked}, scale)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise StateError(f"the weights in {cfg.init_from} do not fit the run's model: {e}") from None
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model
