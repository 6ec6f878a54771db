"""Gemma 2 and Gemma 3 (text) configs to and from Kiln's ModelConfig (kiln.model.hf asks here for these kinds).

    model_type   class               what Kiln's ModelConfig says for it
    gemma2       Gemma2ForCausalLM   norm rmsnorm1p, mlp geglu, sandwich_norm, embed_scale, attn_scale_dim,
                                     attn_softcap, logit_softcap, sliding_window with full_attention_layers
    gemma3_text  Gemma3ForCausalLM   the same with qk_norm, no attention soft-cap (transformers' Gemma 3 applies
                                     none), and the windowed layers' own rotary base (rope_local_theta)

A config.json holds only what differs from transformers' defaults, so each key missing is read as the default of
its class (below). The layer pattern is `layer_types` (transformers 5), or the older `sliding_window_pattern`
(every n-th layer global). Configs are read without transformers.
"""

from __future__ import annotations

from typing import Any

from kiln.config import ModelConfig, RopeScaling
from kiln.errors import StateError

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# transformers' defaults for the keys a config.json may leave out
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, sliding_window_pattern=2, rope_theta=10000.0),
    "gemma3_text": dict(head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                        attn_logit_softcapping=None, sliding_window_pattern=6, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0),
}
# what each kind needs of a ModelConfig (a tuple: any of these; kiln.model.hf asks `problems` before an export)
WANTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, qk_norm=False,
                   attention_bias=("none", "all"), mlp_bias=False, rotary_fraction=1.0, rope_local_theta=None,
                   fused_projections=False, moe=None, layer_pattern=None),
    "gemma3_text": dict(norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, qk_norm=True,
                        attention_bias=("none", "all"), mlp_bias=False, rotary_fraction=1.0, attn_softcap=None,
                        fused_projections=False, moe=None, layer_pattern=None),
}
# what the other architectures need of Gemma's options: none of them
PLAIN = dict(sandwich_norm=False, embed_scale=False, attn_scale_dim=None, attn_softcap=None, logit_softcap=None,
             full_attention_layers=None, rope_local_theta=None)


def problems(cfg: ModelConfig, kind: str) -> list[str]:
    """What of `cfg` the Hugging Face `kind` (gemma2, gemma3_text) cannot hold; [] when it can."""
    out = []
    for key, allowed in WANTS[kind].items():
        value = getattr(cfg, key)
        if not (value in allowed if isinstance(allowed, tuple) else value == allowed):
            out.append("model.moe (a mixture of experts)" if key == "moe" else f"model.{key}={value}")
    return out


def _scaling(rope: dict[str, Any], where: str) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        return RopeScaling(type="linear", factor=rope["factor"])
    if kind == "llama3":
        return RopeScaling(type="llama3", factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                           high_freq_factor=rope["high_freq_factor"],
                           original_max_position_embeddings=rope["original_max_position_embeddings"])
    raise StateError(f"{where}: rope_type={kind} (Kiln has default, linear and llama3)")


def _rope(hf: dict[str, Any], kind: str) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta) of a config.json: transformers 5's rope_parameters (one dict,
    or one per layer type for Gemma 3), else 4.x's rope_theta, rope_scaling and rope_local_base_freq."""
    d = DEFAULTS[kind]
    params = hf.get("rope_parameters") or {}
    if kind == "gemma2":
        rope = params or hf.get("rope_scaling") or {}
        return float(rope.get("rope_theta", hf.get("rope_theta", d["rope_theta"]))), _scaling(rope, kind), None
    full = params.get("full_attention") or {**(hf.get("rope_scaling") or {}),
                                            "rope_theta": hf.get("rope_theta", d["rope_theta"])}
    local = params.get("sliding_attention") or {"rope_type": "default",
                                                "rope_theta": hf.get("rope_local_base_freq", d["rope_local_base_freq"])}
    theta, scaling = float(full.get("rope_theta", d["rope_theta"])), _scaling(full, kind)
    local_theta = float(local.get("rope_theta", d["rope_local_base_freq"]))
    local_scaling = _scaling(local, kind)
    if local_scaling is None:
        return theta, scaling, local_theta
    if local_scaling == scaling and local_theta == theta:  # the local layers rotate as the global ones
        return theta, scaling, None
    raise StateError(f"{kind}: the sliding-window layers' rotary scaling ({local_scaling}) is not the global "
                     "layers' (Kiln scales the local layers' rotation as the global ones' or not at all)")


def full_layers(hf: dict[str, Any], kind: str) -> list[int]:
    """Indices of the layers without the sliding window, from layer_types or sliding_window_pattern."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern",
                                                         DEFAULTS[kind]["sliding_window_pattern"]))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise StateError(f"{kind}: layer_types {types} are not {n} of sliding_attention and full_attention")
    return [i for i, t in enumerate(types) if t == "full_attention"]


def from_gemma(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Gemma 2 or Gemma 3 text config.json; StateError for what Kiln cannot represent."""
    kind = hf["model_type"]
    d = DEFAULTS[kind]
    get = lambda key: hf.get(key, d.get(key))  # noqa: E731 - a missing key is transformers' default
    problems = []
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"  # transformers' Gemma 2/3 never read hidden_act
    if act not in ("gelu_pytorch_tanh", "gelu_new"):  # GELU's tanh approximation, two names
        problems.append(f"hidden_activation={act}")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (an encoder)")
    if problems:
        raise StateError(f"this {kind} config uses features Kiln's model does not have: {', '.join(problems)}")
    theta, scaling, local_theta = _rope(hf, kind)
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = get("head_dim") or width // heads
    window = get("sliding_window")
    full = full_layers(hf, kind)
    scalar = float(get("query_pre_attn_scalar"))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=width, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf["intermediate_size"],
        head_size=None if head_dim * heads == width else head_dim, max_seq_len=get("max_position_embeddings"),
        rope_theta=theta, rope_scaling=scaling, norm_eps=get("rms_norm_eps"),
        tie_embeddings=bool(get("tie_word_embeddings")), init_std=hf.get("initializer_range", 0.02),
        attention_bias="all" if hf.get("attention_bias") else "none", norm="rmsnorm1p", mlp="geglu",
        qk_norm=kind == "gemma3_text", sandwich_norm=True, embed_scale=True,
        attn_scale_dim=None if scalar == head_dim else scalar,  # the usual 1/sqrt(head_dim): no option
        attn_softcap=get("attn_logit_softcapping") if kind == "gemma2" else None,  # transformers' Gemma 3: none
        logit_softcap=get("final_logit_softcapping"),
        sliding_window=window if window is not None and len(full) < hf["num_hidden_layers"] else None,
        full_attention_layers=full if window is not None and 0 < len(full) < hf["num_hidden_layers"] else None,
        rope_local_theta=local_theta if kind == "gemma3_text" else None, hf_model_type=kind,
    )


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None and scaling.type == "linear":
        rope.update(rope_type="linear", factor=scaling.factor)
    elif scaling is not None:
        rope.update(rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                    high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_max_position_embeddings)
    return rope


def _number(x: float) -> float | int:
    """A whole number as an int (transformers types query_pre_attn_scalar so)."""
    return int(x) if float(x).is_integer() else x


def to_gemma(cfg: ModelConfig, kind: str) -> dict[str, Any]:
    """The config.json fields of `cfg` as a `kind` model (gemma2 or gemma3_text)."""
    full = set(cfg.full_attention_layers or ())
    windowed = cfg.sliding_window is not None
    types = ["sliding_attention" if windowed and i not in full else "full_attention" for i in range(cfg.n_layers)]
    global_rope = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "attention_bias": cfg.attention_bias != "none", "attention_dropout": 0.0,
        "query_pre_attn_scalar": _number(cfg.attn_scale_dim if cfg.attn_scale_dim is not None else cfg.head_dim),
        "sliding_window": cfg.sliding_window, "layer_types": types,
        "final_logit_softcapping": cfg.logit_softcap, "attn_logit_softcapping": cfg.attn_softcap,
    }
    if kind == "gemma2":
        out["rope_parameters"] = global_rope
    else:
        local = global_rope if cfg.rope_local_theta is None else _rope_dict(cfg.rope_local_theta, None)
        out["rope_parameters"] = {"full_attention": global_rope, "sliding_attention": local}
    return out
