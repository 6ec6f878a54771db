"""Kiln's LoRA adapters in PEFT's format, which `peft.PeftModel.from_pretrained(base, dir)` loads.

    write_peft_adapters(adapters, model_cfg, cfg.lora, base="path/to/base", out="adapter/")

A PEFT adapter directory holds `adapter_model.safetensors`, keyed

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight    (r x in)
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight    (out x r)

(Kiln's key with Hugging Face's `model.` and PEFT's `base_model.model.` before it), and
`adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules in Hugging Face
names, base_model_name_or_path). Nothing here imports peft.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.config import LoraConfig, ModelConfig
from kiln.errors import StateError
from kiln.model.hf import to_hf_state_dict
from kiln.model.lora import hf_target_modules, is_adapter_key

PREFIX = "base_model.model."
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def to_peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kiln adapter keys -> PEFT's saved keys (non-adapter keys are an error: only adapters are saved)."""
    other = [k for k in adapters if not is_adapter_key(k)]
    if other:
        raise ValueError(f"not adapter tensors: {other[:3]}")
    return {PREFIX + k: v for k, v in to_hf_state_dict(adapters, tie_embeddings=False).items()}


def from_peft_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved keys -> Kiln adapter keys."""
    out = {}
    for key, value in state.items():
        if not key.startswith(PREFIX + "model."):
            raise StateError(f"{key}: not a LoRA adapter of a decoder layer Kiln's model has")
        out[key.removeprefix(PREFIX + "model.")] = value
    return out


def peft_config(model_cfg: ModelConfig, lcfg: LoraConfig, base: str | None) -> dict:
    """The adapter_config.json of these adapters (the fields PEFT's LoraConfig reads); a `base` in huggingface_hub's
    cache is named by its Hub id and revision (kiln.model.hub.snapshot_of), which AutoPeftModel loads anywhere."""
    from kiln.model.hub import published_base

    name, revision = published_base(base)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": name, "revision": revision,
        "r": lcfg.rank, "lora_alpha": lcfg.alpha, "lora_dropout": lcfg.dropout,
        "target_modules": hf_target_modules(model_cfg, lcfg.targets), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def peft_refusal(adapters: dict[str, torch.Tensor], model_cfg: ModelConfig | None = None) -> str | None:
    """Why these adapters have no PEFT form Kiln writes (None: they have one): a mixture of experts' per-expert
    adapters (kiln.model.lora_experts), adapters on a hybrid model's Mamba out_proj (which PEFT refuses), or a run
    of `model_cfg` that extended its base's context (kiln.model.base_context), which the merged model holds
    instead."""
    from kiln.model.base_context import extended_context
    from kiln.model.lora_experts import stacked_adapter

    if any(stacked_adapter(k) is not None for k in adapters):
        return ("the adapters on the mixture of experts' stacked expert projections (lora.targets gate, up, down) "
                "have no PEFT form Kiln writes; the merged model (kiln export without --adapters) holds them")
    if model_cfg is not None and model_cfg.layer_pattern and any(".mixer.out_proj." in k for k in adapters):
        return ("PEFT refuses LoRA on a Mamba layer's out_proj (transformers' fused Mamba kernels read its weight "
                "directly), so these adapters have no PEFT form it loads; the merged model (kiln export without "
                "--adapters) holds them, or train with lora.targets that leave out out_proj (q, k, v, o, up, down, "
                "in_proj) for PEFT adapters")
    extended = extended_context(model_cfg) if model_cfg is not None else None
    if extended is not None:
        return (f"{extended}, and PEFT adapters load onto the base as it is stored, with its own context and rotary "
                "scaling, so they would not give the model that was trained; the merged model (kiln export without "
                "--adapters) holds the new context in its config.json")
    return None


def write_peft_adapters(adapters: dict[str, torch.Tensor], model_cfg: ModelConfig, lcfg: LoraConfig,
                        base: str | None, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `adapters` (Kiln keys) as a PEFT adapter directory `out`; `dtype` casts them (None: as they are)."""
    if not adapters:
        raise StateError("no LoRA adapters to write: this model was not trained with lora.rank > 0")
    why = peft_refusal(adapters, model_cfg)
    if why is not None:
        raise StateError(why)
    return save_peft(adapters, peft_config(model_cfg, lcfg, base), out, dtype)


def save_peft(adapters: dict[str, torch.Tensor], config: dict, out: str | Path, dtype: torch.dtype | None = None
              ) -> Path:
    """adapter_model.safetensors (from Kiln adapter keys) and adapter_config.json (`config`) in `out`."""
    from safetensors.torch import save_file

    from kiln.files import atomic_write_json, replace_file

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in to_peft_state_dict(adapters).items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    replace_file(tmp, out / WEIGHTS)
    atomic_write_json(out / CONFIG, config, indent=2)
    return out


def read_peft_adapters(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(Kiln adapter state dict, adapter_config.json) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    try:
        config = json.loads((p / CONFIG).read_text())
        state = load_file(str(p / WEIGHTS))
    except FileNotFoundError as e:
        raise StateError(f"{p} is not a LoRA adapter directory: {e.filename} is missing") from None
    except Exception as e:  # safetensors raises its own error type on a damaged file
        raise StateError(f"the LoRA adapters in {p} cannot be read ({e})") from None
    return from_peft_state_dict(state), config
