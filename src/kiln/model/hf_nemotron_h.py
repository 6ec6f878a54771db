"""Nemotron-H (`NemotronHForCausalLM`, model_type nemotron_h) and Kiln's hybrid model: config fields and names.

A Nemotron-H layer is one of Mamba-2 ('M'), attention without position embeddings ('*') or a squared-ReLU MLP
('-'), each x + mixer(RMSNorm(x)); `hybrid_override_pattern` lists them (newer configs: `layers_block_type`).
Kiln holds it as `model.layer_pattern` with `model.mamba`; its parameter names are Hugging Face's without the
`model.` prefix, except the two top-level ones in `TOP_LEVEL` (Kiln's names are its Llama model's).

Mixture-of-experts layers ('E', the Nemotron 3 models) and multi-token-prediction heads are not in the native
model: a config with 'E' layers is refused (model.hf_class=auto trains it), and `mtp.*` weights are dropped on
import, as transformers drops them. The time-step clamp follows the config's `time_step_limit`, as Mamba-2's
kernels do ((0, inf): none); transformers 5.2x's PyTorch path clamps at `time_step_min` instead, which differs
only for steps below it (0.001 in the released models).
"""

from __future__ import annotations

import math
from typing import Any

from kiln.config import MambaConfig, ModelConfig
from kiln.errors import StateError

ARCHITECTURE = "NemotronHForCausalLM"
TOP_LEVEL = {"embed_tokens.weight": "embeddings.weight", "norm.weight": "norm_f.weight"}  # Kiln -> HF, in model.
_KINDS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}


def is_hybrid_state(keys) -> bool:
    """Whether a Kiln state dict's keys are a hybrid model's (its layers hold a `mixer`)."""
    return any(".mixer." in k for k in keys)


def model_key(key: str) -> str:
    """A checkpoint's key under transformers' module names: Nemotron-H files name the decoder `backbone.`."""
    return f"model.{key.removeprefix('backbone.')}" if key.startswith("backbone.") else key


def file_key(key: str) -> str:
    """A key under transformers' module names as Nemotron-H files name it (`model_key` undone): the decoder `backbone.`,
    as the released checkpoints and transformers' own save_pretrained write it, and as readers of those files
    (transformers 4, converters) look for it."""
    return f"backbone.{key.removeprefix('model.')}" if key.startswith("model.") else key


def _number(value: Any) -> float:
    """A float of config.json: transformers 5.2x writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def pattern_of(hf: dict[str, Any]) -> str:
    pattern = hf.get("hybrid_override_pattern")
    if pattern is None:
        kinds = hf.get("layers_block_type") or hf.get("layer_types")
        if not isinstance(kinds, list):
            raise StateError("this nemotron_h config has neither hybrid_override_pattern nor layers_block_type")
        unknown = sorted({k for k in kinds if k not in _KINDS})
        if unknown:
            raise StateError(f"this nemotron_h config has layer types Kiln does not know: {unknown}")
        pattern = "".join(_KINDS[k] for k in kinds)
    return pattern


def model_config(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a nemotron_h `config.json` dict; StateError for what the native model does not have."""
    pattern = pattern_of(hf)
    problems = []
    if "E" in pattern:
        problems.append("mixture-of-experts layers ('E' in its layer pattern; model.hf_class=auto trains them)")
    if set(pattern) - set("M*-E"):
        problems.append(f"layer kinds {sorted(set(pattern) - set('M*-E'))} in hybrid_override_pattern")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]}")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if hf.get("sliding_window") is not None:
        problems.append(f"sliding_window={hf['sliding_window']}")
    if problems:
        raise StateError(f"this nemotron_h config uses features Kiln's model does not have: {', '.join(problems)}")
    d, heads = hf["hidden_size"], hf.get("num_attention_heads", 32)
    head_dim = hf.get("head_dim") or d // heads
    limit = hf.get("time_step_limit", hf.get("mamba_dt_limit", (0.0, math.inf)))
    mamba = MambaConfig(
        heads=hf.get("mamba_num_heads", 128), head_dim=hf.get("mamba_head_dim", 64),
        state=hf.get("ssm_state_size", 128), groups=hf.get("n_groups", hf.get("mamba_n_groups", 8)),
        conv_kernel=hf.get("conv_kernel", hf.get("mamba_d_conv", 4)),
        chunk=hf.get("chunk_size", hf.get("mamba_chunk_size", 128)),
        dt_min=hf.get("time_step_min", 0.001), dt_max=hf.get("time_step_max", 0.1),
        dt_floor=hf.get("time_step_floor", 1e-4), dt_limit=(_number(limit[0]), _number(limit[1])),
        conv_bias=bool(hf.get("use_conv_bias", True)), proj_bias=bool(hf.get("use_bias", False)))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=len(pattern), n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf.get("intermediate_size", 4 * d),
        head_size=None if head_dim * heads == d else head_dim, max_seq_len=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02), mlp_bias=bool(hf.get("mlp_bias", False)), mlp="relu2",
        norm="rmsnorm", layer_pattern=pattern, mamba=mamba, hf_model_type="nemotron_h")


def unsupported(cfg: ModelConfig, kind: str) -> list[str]:
    """Why the Hugging Face architecture `kind` cannot hold `cfg`, where one of the two is Nemotron-H ([]: it can)."""
    if kind != "nemotron_h":
        return [f"model.layer_pattern={cfg.layer_pattern!r}"]
    out = [] if cfg.layer_pattern is not None else ["model.layer_pattern=None"]
    wants = {"norm": "rmsnorm", "mlp": "relu2", "attention_bias": "none", "sliding_window": None, "moe": None,
             "qk_norm": False, "fused_projections": False}
    return out + [f"model.{key}={getattr(cfg, key)}" for key, allowed in wants.items()
                  if getattr(cfg, key, allowed) != allowed]


def config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of the NemotronHForCausalLM that holds `cfg`."""
    m = cfg.mamba
    return {
        "architectures": [ARCHITECTURE], "model_type": "nemotron_h", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "hybrid_override_pattern": cfg.layer_pattern, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_hidden, "mlp_hidden_act": "relu2", "mlp_bias": cfg.mlp_bias,
        "attention_bias": False, "max_position_embeddings": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "mamba_num_heads": cfg.mamba_heads, "mamba_head_dim": m.head_dim, "ssm_state_size": m.state,
        "n_groups": m.groups, "conv_kernel": m.conv_kernel, "chunk_size": m.chunk, "mamba_hidden_act": "silu",
        "time_step_min": m.dt_min, "time_step_max": m.dt_max, "time_step_floor": m.dt_floor,
        "use_conv_bias": m.conv_bias, "use_bias": m.proj_bias, "residual_in_fp32": False, "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        # written only when it clamps: JSON has no infinity (Python writes Infinity, which strict parsers refuse)
        **({"time_step_limit": list(m.dt_limit)} if m.dt_limit != (0.0, math.inf) else {}),
    }
