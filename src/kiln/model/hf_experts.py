"""Mixture-of-experts models between Kiln and Hugging Face: Mixtral, Qwen2-MoE and Qwen3-MoE (kiln.model.hf).

Config: each family's fields to `model.moe` (kiln.config.moe) and back.

Weights: Kiln holds each layer's experts stacked, as transformers 5 does in memory,

    layers.N.mlp.experts.gate_up_proj   (E, 2h, d)   each expert's gate rows, then its up rows
    layers.N.mlp.experts.down_proj      (E, d, h)

while checkpoints on disk (the Hub's, and what transformers 4 and 5 write) keep one Linear per expert:

    Qwen:     model.layers.N.mlp.experts.J.{gate_proj,up_proj,down_proj}.weight
    Mixtral:  model.layers.N.block_sparse_moe.experts.J.{w1,w3,w2}.weight      (w1 gate, w3 up, w2 down)
              model.layers.N.block_sparse_moe.gate.weight                        (the router, Kiln's mlp.gate)

Both layouts are read (a directory saved with the fused names loads as it is); exports write the per-expert one.
`expert_slot` maps one per-expert key to the rows of the stacked parameter it fills, so a sharded model can read
its own rows of each expert straight from the files (kiln.parallel.materialize).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kiln.config import ModelConfig, MoEConfig

MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
_PER_EXPERT = re.compile(r"^(.*layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MIXTRAL_NAME = {"gate": "w1", "up": "w3", "down": "w2"}


def expert_slot(key: str) -> tuple[str, int, str] | None:
    """(stacked Kiln parameter name, expert index, 'gate'|'up'|'down') of a per-expert key (its `model.` prefix
    dropped, or kept: the name keeps what came before `layers.`); None for any other key."""
    m = _PER_EXPERT.match(key)
    if m is None:
        return None
    prefix, index, part = m.group(1), int(m.group(2)), _PART[m.group(3)]
    return f"{prefix}mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}", index, part


def renamed(key: str) -> str:
    """Mixtral's `block_sparse_moe.` module is Kiln's (and transformers 5's) `mlp.`."""
    return key.replace(".block_sparse_moe.", ".mlp.")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with per-expert weights -> the same with each layer's experts stacked (other keys as they are)."""
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, value in state.items():
        slot = expert_slot(key)
        if slot is None:
            out[renamed(key)] = value
            continue
        name, index, part = slot
        parts.setdefault(name, {}).setdefault(index, {})[part] = value
    for name, experts in parts.items():
        order = [experts[i] for i in sorted(experts)]
        if name.endswith("down_proj"):
            out[name] = torch.stack([e["down"] for e in order])
        else:
            out[name] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in order])
    return out


def unstack_experts(state: dict[str, torch.Tensor], mixtral: bool) -> dict[str, torch.Tensor]:
    """Kiln's stacked experts -> one tensor per expert and projection, named as Qwen's or (`mixtral`) Mixtral's
    checkpoints name them; Mixtral's router and experts under `block_sparse_moe.`."""
    out = {}
    for key, value in state.items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            layer = key.removesuffix("gate_up_proj").removesuffix("down_proj")  # '...mlp.experts.'
            if mixtral:
                layer = layer.replace(".mlp.", ".block_sparse_moe.")
            for j in range(value.shape[0]):
                if key.endswith("down_proj"):
                    out[f"{layer}{j}.{_MIXTRAL_NAME['down'] if mixtral else 'down_proj'}.weight"] = value[j]
                    continue
                gate, up = value[j].chunk(2)
                out[f"{layer}{j}.{_MIXTRAL_NAME['gate'] if mixtral else 'gate_proj'}.weight"] = gate
                out[f"{layer}{j}.{_MIXTRAL_NAME['up'] if mixtral else 'up_proj'}.weight"] = up
        elif mixtral and ".mlp.gate." in key:
            out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value
        else:
            out[key] = value
    return out


def moe_from_hf(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """ModelConfig fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json ({} for other kinds)."""
    if kind not in MOE_KINDS:
        return {}
    n_layers = hf["num_hidden_layers"]
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if kind == "mixtral":
        moe = MoEConfig(n_experts=hf.get("num_local_experts", n_experts or 8), top_k=hf.get("num_experts_per_tok", 2),
                        expert_hidden=hf["intermediate_size"], norm_topk=True,
                        aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
        return {"moe": moe}
    step, only = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in only or not (n_experts and (i + 1) % step == 0)]
    shared = hf.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    moe = MoEConfig(n_experts=n_experts or 1, top_k=hf.get("num_experts_per_tok", 1),
                    expert_hidden=hf["moe_intermediate_size"], norm_topk=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_hidden=shared or None, dense_layers=dense,
                    aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    return {"moe": moe, "qk_norm": kind == "qwen3_moe"}


def moe_hf_problems(hf: dict[str, Any], kind: str) -> list[str]:
    """What of a mixture-of-experts config.json Kiln's model does not have."""
    if kind == "mixtral" and hf.get("router_jitter_noise"):
        return [f"router_jitter_noise={hf['router_jitter_noise']}"]
    return []


def moe_to_hf(cfg: ModelConfig, kind: str) -> dict[str, Any]:
    """The config.json fields of `cfg`'s mixture of experts for `kind` ({} for other kinds)."""
    m = cfg.moe
    if kind not in MOE_KINDS or m is None:
        return {}
    out: dict[str, Any] = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef,
                           "output_router_logits": False}
    if kind == "mixtral":
        return {**out, "num_local_experts": m.n_experts, "intermediate_size": m.expert_hidden,
                "router_jitter_noise": 0.0}
    out.update(num_experts=m.n_experts, moe_intermediate_size=m.expert_hidden, norm_topk_prob=m.norm_topk,
               decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers))
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=m.shared_expert_hidden, qkv_bias=cfg.attention_bias != "none")
    return out


def moe_problems(cfg: ModelConfig, kind: str) -> list[str]:
    """Why Hugging Face's `kind` cannot hold `cfg`'s mixture of experts (or q/k norms); [] when it can."""
    m = cfg.moe
    out = []
    if kind not in MOE_KINDS:
        if m is not None:
            out.append("model.moe (a mixture of experts)")
        if cfg.qk_norm and kind not in QK_NORM_KINDS:
            out.append("model.qk_norm=True")
        return out
    if m is None:
        return ["no model.moe (a dense MLP)"]
    if cfg.qk_norm != (kind == "qwen3_moe"):
        out.append(f"model.qk_norm={cfg.qk_norm}")
    if (m.shared_expert_hidden is not None) != (kind == "qwen2_moe"):
        out.append(f"model.moe.shared_expert_hidden={m.shared_expert_hidden}")
    if kind == "mixtral":
        if m.dense_layers:
            out.append(f"model.moe.dense_layers={m.dense_layers}")
        if not m.norm_topk:
            out.append("model.moe.norm_topk=False")
    return out


# kinds beside the MoE ones whose attention has q/k norms (kiln.model.hf adds Qwen3 here)
QK_NORM_KINDS: tuple[str, ...] = ("qwen3",)
