"""Mapping between Kiln's model and Hugging Face causal LMs: config and state dict, both ways.

These architectures map onto the native model (`kiln.model.llama.Transformer`):

    model_type  class                 what Kiln's ModelConfig says for it
    llama       LlamaForCausalLM      the defaults; rope_scaling (Llama 3.1), attention/mlp biases
    mistral     MistralForCausalLM    sliding_window (where set), head_size
    qwen2       Qwen2ForCausalLM      attention_bias='qkv', tied embeddings in the small ones
    nemotron    NemotronForCausalLM   mlp='relu2' (no gate), norm='layernorm1p', rotary_fraction
    mixtral     MixtralForCausalLM    moe (top-k renormalised), sliding_window (kiln.model.hf_experts)
    qwen2_moe   Qwen2MoeForCausalLM   moe with a gated shared expert, attention_bias='qkv'
    qwen3_moe   Qwen3MoeForCausalLM   moe, qk_norm
    qwen3       Qwen3ForCausalLM      qk_norm, head_size, attention_bias on all four projections or none
    phi3        Phi3ForCausalLM       fused_projections (qkv_proj, gate_up_proj, kept fused), sliding_window
    nemotron_h  NemotronHForCausalLM  layer_pattern (Mamba-2, attention, MLP layers), mamba: kiln.model.hf_nemotron_h
    gemma2      Gemma2ForCausalLM     Gemma's options (sandwich norms, soft-caps, local/global layers): hf_gemma
    gemma3_text Gemma3ForCausalLM     the same with q/k norms and a local rotary base: kiln.model.hf_gemma

A model trained from scratch exports as the first of FROM_SCRATCH that holds it (Qwen3 for q/k norms, Phi-3 for
fused projections; q/k/v biases as Llama's attention biases with a zero o_proj bias: transformers would load a
Qwen2 directory's tokenizer as its own Qwen2Tokenizer, not the tokenizer.json Kiln trained); a shape none holds
is said before training (`export_problem`).

Kiln's modules carry HF's names without the `model.` prefix and use the same rotary layout, so the
weights map one to one with no permutation. Only `hf_config` imports transformers (an optional extra).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.config import ModelConfig, RopeScaling
from kiln.errors import ConfigError, StateError
from kiln.model import hf_experts, hf_gemma, hf_nemotron_h

_TOP_LEVEL = ("lm_head.",)  # keys HF keeps outside its `model.` submodule
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "nemotron": "NemotronForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "nemotron_h": hf_nemotron_h.ARCHITECTURE, **hf_gemma.ARCHITECTURES}


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that holds `cfg`: the one it was imported from (or model.hf_model_type names),
    else the first of llama, mistral, nemotron, qwen2 that can. StateError if none can (`export_problem`)."""
    if cfg.hf_model_type is not None:
        problems = _unsupported(cfg, cfg.hf_model_type)
        if problems:
            raise StateError(f"{ARCHITECTURES[cfg.hf_model_type]} cannot hold this model: {', '.join(problems)}; set "
                             "model.hf_model_type to one that can, or leave it null")
        return cfg.hf_model_type
    problem = export_problem(cfg)
    if problem is not None:
        raise StateError(problem)
    return next(kind for kind in FROM_SCRATCH if not _unsupported(cfg, kind))


# a model trained from scratch exports as the first of these that holds it: Llama before Qwen2 for q/k/v biases
# (a zero o_proj bias), since transformers loads a Qwen2 directory's tokenizer as Qwen2Tokenizer, built from
# the vocabulary with Qwen2's own pre-tokenizer, instead of the tokenizer.json Kiln trained
FROM_SCRATCH = ("llama", "mistral", "nemotron", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "qwen2_moe",
                "nemotron_h", "gemma2", "gemma3_text")  # nemotron_h: hybrid models alone


def export_problem(cfg: ModelConfig) -> str | None:
    """Why no Hugging Face class can hold `cfg` (None: one can), said to a user before training: `kiln export`
    will not be able to write the model."""
    kinds = [cfg.hf_model_type] if cfg.hf_model_type is not None else list(FROM_SCRATCH)
    problems = {kind: _unsupported(cfg, kind) for kind in kinds}
    if any(not p for p in problems.values()):
        return None
    why = "; ".join(f"{ARCHITECTURES[k]} cannot have {', '.join(p)}" for k, p in problems.items())
    return (f"no Hugging Face class holds this model shape ({why}), so `kiln export` will not be able to write it "
            "(training, checkpoints, kiln eval and kiln generate work). To export it, use a shape one of them holds: "
            "rmsnorm with swiglu (Llama; Mistral for a sliding window, without rope_scaling or biases), layernorm1p "
            "with relu2 (Nemotron), qk_norm (Qwen3), fused_projections (Phi-3), rmsnorm1p with geglu, sandwich_norm "
            "and embed_scale (Gemma 2; Gemma 3 with qk_norm)")


def _unsupported(cfg: ModelConfig, kind: str) -> list[str]:
    if kind in hf_gemma.WANTS:
        return hf_gemma.problems(cfg, kind)
    if kind == "nemotron_h" or cfg.layer_pattern is not None:
        return hf_nemotron_h.unsupported(cfg, kind)
    wants = {  # option: value each architecture needs (None: any)
        "llama": dict(norm="rmsnorm", mlp="swiglu", sliding_window=None, rotary_fraction=1.0,
                      attention_bias=("none", "qkv", "all")),  # qkv: written with a zero o_proj bias
        "mistral": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("none",), mlp_bias=False,
                        rotary_fraction=1.0, rope_scaling=None),
        "qwen2": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("qkv",), mlp_bias=False, rotary_fraction=1.0),
        "nemotron": dict(norm="layernorm1p", mlp="relu2", sliding_window=None, attention_bias=("none", "all")),
        "mixtral": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("none",), mlp_bias=False, rotary_fraction=1.0,
                        rope_scaling=None),
        "qwen2_moe": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("qkv",), mlp_bias=False, rotary_fraction=1.0),
        "qwen3_moe": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("none", "all"), mlp_bias=False,
                          rotary_fraction=1.0),
        "qwen3": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("none", "qkv", "all"), mlp_bias=False,
                      rotary_fraction=1.0, qk_norm=True),
        "phi3": dict(norm="rmsnorm", mlp="swiglu", attention_bias=("none",), mlp_bias=False,
                     fused_projections=True),
    }[kind]
    wants = {"fused_projections": False, **hf_gemma.PLAIN, **wants}  # Phi-3's own; Gemma's
    out = hf_experts.moe_problems(cfg, kind)
    for key, allowed in wants.items():
        value = getattr(cfg, key)
        ok = value in allowed if isinstance(allowed, tuple) else value == allowed
        if not ok:
            out.append(f"model.{key}={value}")
    s = cfg.rope_scaling
    if s is not None and (s.type == "longrope") != (kind == "phi3"):  # Phi-3's longrope alone, and only it
        out.append(f"model.rope_scaling.type={s.type}")
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is not None and s.type == "linear":
        rope.update(rope_type="linear", factor=s.factor)
    elif s is not None and s.type == "longrope":
        rope.update(rope_type="longrope", short_factor=s.short_factor, long_factor=s.long_factor, factor=s.factor,
                    attention_factor=s.attention_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    elif s is not None:
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    if cfg.rotary_fraction != 1.0:
        rope["partial_rotary_factor"] = cfg.rotary_fraction
    return rope


def to_hf_config_dict(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The `config.json` fields of the equivalent Hugging Face model (extra: e.g. bos/eos ids, dtype)."""
    if cfg.vocab_size is None:
        raise ValueError("ModelConfig.vocab_size must be set to describe the model to Hugging Face")
    kind = hf_model_type(cfg)
    if kind in hf_gemma.WANTS:
        return {**hf_gemma.to_gemma(cfg, kind), **extra}
    if kind == "nemotron_h":
        return {**hf_nemotron_h.config_dict(cfg), **extra}
    rope = _rope_parameters(cfg)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "relu2" if cfg.mlp == "relu2" else "silu", "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,  # transformers 5; 4.x reads rope_scaling
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "attention_dropout": 0.0,
    }
    if kind == "nemotron":
        out.update(norm_eps=cfg.norm_eps, partial_rotary_factor=cfg.rotary_fraction)
    else:
        out["rms_norm_eps"] = cfg.norm_eps
    if kind in ("llama", "nemotron"):
        out.update(attention_bias=cfg.attention_bias != "none", mlp_bias=cfg.mlp_bias)
    if kind in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window  # written even when null: Mistral's default is 4096
    if kind == "phi3":
        # Phi-3's default special ids (bos 1, eos and pad 32000) are its tokenizer's: none unless `extra` gives them
        out.update(sliding_window=cfg.sliding_window, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        if cfg.rope_scaling is not None:  # longrope: Phi-3 reads this key, not the one in rope_parameters
            out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    if kind in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = cfg.attention_bias != "none"  # qwen3 with qkv: a zero o_proj bias
    out.update(hf_experts.moe_to_hf(cfg, kind))
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        sliding = cfg.sliding_window is not None
        out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if sliding else cfg.n_layers)
    return {**out, **extra}


def hf_config(cfg: ModelConfig, **extra: Any):
    """The transformers config object for the same model (needs the `hf` extra)."""
    from transformers import AutoConfig

    fields = to_hf_config_dict(cfg, **extra)
    kind = fields.pop("model_type")
    fields.pop("architectures")
    return AutoConfig.for_model(kind, **fields)


def _hf_problems(hf: dict[str, Any], kind: str) -> list[str]:
    problems = []
    act = hf.get("hidden_act", "relu2" if kind == "nemotron" else "silu")
    if act != ("relu2" if kind == "nemotron" else "silu"):
        problems.append(f"hidden_act={act}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", None) and not (kind == "phi3" and rope_type in LONGROPE):
        key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        problems.append(f"{key}.rope_type={rope_type} (Kiln has default, linear and llama3)")
    problems += hf_experts.moe_hf_problems(hf, kind)
    if kind in QWEN and len(_qwen_attention(hf)) > 1:
        problems.append("a sliding window on some layers only (use_sliding_window with max_window_layers > 0)")
    if kind == "mistral" and hf.get("layer_types"):
        problems.append("layer_types (alternating attention)")
    return problems


QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _qwen_attention(hf: dict[str, Any]) -> set[str]:
    """The attention kinds of a Qwen config's layers, as transformers reads them: a window only with
    use_sliding_window and a sliding_window, on the layers layer_types names (else from max_window_layers on)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window", 4096) is None:
        return {"full_attention"}
    n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
    return set(hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)])


LONGROPE = ("longrope", "su", "yarn")  # Phi-3's names of it (transformers reads all three as longrope)


def _longrope(hf: dict[str, Any], rope: dict[str, Any]) -> RopeScaling:
    """Phi-3's longrope as transformers reads it: original_max_position_embeddings from config.json's top level
    (Phi-3's default 4096), the attention factor from factor, else from the context's growth over it."""
    old = hf.get("original_max_position_embeddings", 4096)
    factor = rope.get("factor") or hf.get("max_position_embeddings", old) / old
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1.0 else 1.0
    return RopeScaling(type="longrope", factor=factor, original_max_position_embeddings=old,
                       short_factor=rope["short_factor"], long_factor=rope["long_factor"], attention_factor=attention)


_NOT_DROPOUT = ("classifier_", "summary_")  # heads a causal LM does not train with


def unapplied_dropout(hf: dict[str, Any]) -> str | None:
    """What of a config.json's dropout Kiln's native model does not apply: it has no dropout, so its fields above 0
    (attention_dropout, hidden_dropout, resid_pdrop, embd_pdrop, ...) are said, not silently dropped; None where
    there are none (modern bases set 0.0). Not refused: the weights and the model's function are the same, only
    the regularisation of training differs."""
    fields = [f"{k}={v:g}" for k, v in hf.items() if k.endswith(("dropout", "pdrop", "dropout_prob"))
              and not k.startswith(_NOT_DROPOUT) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    if not fields:
        return None
    return (f"its config.json asks for dropout in training ({', '.join(fields)}), and Kiln's native model has none: "
            "this run trains without it. To train with it, set model.hf_class=auto (transformers' own module, "
            "slower); to train without it and not be told, set those fields to 0.0 in a copy of the directory")


def from_hf_config_dict(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a `config.json` dict; raises StateError for what Kiln cannot represent, ConfigError for a
    config.json that lacks a field its model type needs or holds one of the wrong kind (a damaged or partial one)."""
    try:
        return _from_hf_config_dict(hf)
    except (KeyError, TypeError, ValueError) as e:
        said = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()) if hasattr(e, "errors") \
            else str(e)  # pydantic's, of the ModelConfig it makes
        what = f"lacks {e}" if isinstance(e, KeyError) else f"holds a value Kiln cannot read ({said})"
        raise ConfigError(f"this {hf.get('model_type')} config.json {what}: it is not a complete Hugging "
                          "Face model config; copy the model directory again from its source") from None


def _from_hf_config_dict(hf: dict[str, Any]) -> ModelConfig:
    kind = hf.get("model_type")
    if kind is None:  # a directory's config.json without one is refused as it is read (hf_import.read_hf_config)
        raise StateError("the config names no model_type (transformers reads it with the model's own code: "
                         "config.json auto_map)")
    if kind not in ARCHITECTURES:
        raise StateError(f"model_type '{kind}' is not one Kiln's native model imports (it imports "
                         f"{', '.join(ARCHITECTURES)})")
    if kind == "nemotron_h":
        return hf_nemotron_h.model_config(hf)
    if kind in hf_gemma.WANTS:
        return hf_gemma.from_gemma(hf)
    problems = _hf_problems(hf, kind)
    if problems:
        raise StateError(f"this {kind} config uses features Kiln's model does not have: {', '.join(problems)}")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or (128 if kind == "qwen3" else d // heads)  # Qwen3's default head_dim
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "linear":
        scaling = RopeScaling(type="linear", factor=rope["factor"])
    elif rope_type in LONGROPE and kind == "phi3":
        scaling = _longrope(hf, rope)
    elif rope_type == "llama3":
        scaling = RopeScaling(type="llama3", factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                              high_freq_factor=rope["high_freq_factor"],
                              original_max_position_embeddings=rope["original_max_position_embeddings"])
    bias = bool(hf.get("attention_bias", False))
    window = None
    if kind == "mistral":
        window = hf.get("sliding_window", 4096)  # Mistral's default when the key is absent
    elif kind == "mixtral":
        window = hf.get("sliding_window")
    elif kind in QWEN and _qwen_attention(hf) == {"sliding_attention"}:
        window = hf.get("sliding_window", 4096)
    elif kind == "phi3":
        window = hf.get("sliding_window")
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5 if kind == "nemotron" else 1.0))
    eps = 1e-5 if kind == "phi3" else 1e-6  # rms_norm_eps where config.json leaves it out: the class's default
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf["intermediate_size"],
        head_size=None if head_dim * heads == d else head_dim,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf.get("norm_eps", 1e-5) if kind == "nemotron" else hf.get("rms_norm_eps", eps),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02),
        attention_bias="qkv" if kind == "qwen2" or (kind == "qwen2_moe" and hf.get("qkv_bias", True))
        else ("all" if bias else "none"),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        mlp="relu2" if kind == "nemotron" else "swiglu", norm="layernorm1p" if kind == "nemotron" else "rmsnorm",
        rotary_fraction=float(fraction), rope_scaling=scaling, sliding_window=window, hf_model_type=kind,
        **hf_experts.moe_from_hf(hf, kind),
        **({"qk_norm": True} if kind == "qwen3" else {}), fused_projections=kind == "phi3",
    )


def to_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool, zero_o_bias: bool = False,
                     kind: str | None = None) -> dict[str, torch.Tensor]:
    """Kiln state dict -> Hugging Face state dict (tied: lm_head.weight left out, as HF saves it). `zero_o_bias`:
    a zero o_proj bias beside each o_proj weight (q/k/v biases written as Llama's attention_bias). Stacked
    experts are written one per expert, named as `kind`'s checkpoints name them (kiln.model.hf_experts)."""
    state = hf_experts.unstack_experts(state, mixtral=kind == "mixtral")
    out = {}
    renames = hf_nemotron_h.TOP_LEVEL if hf_nemotron_h.is_hybrid_state(state) else {}
    for key, value in state.items():
        if key == "lm_head.weight" and tie_embeddings:
            continue
        out[key if key.startswith(_TOP_LEVEL) else f"model.{renames.get(key, key)}"] = value
        if zero_o_bias and key.endswith("o_proj.weight"):
            out[f"model.{key.removesuffix('weight')}bias"] = value.new_zeros(value.shape[0])
    return out


def zero_o_bias(cfg: ModelConfig) -> bool:
    """True when `cfg` exports with a zero o_proj bias: q/k/v biases held by an architecture with all four."""
    return cfg.attention_bias == "qkv" and hf_model_type(cfg) in ("llama", "nemotron", "qwen3")


def from_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """Hugging Face state dict -> Kiln state dict (rotary caches dropped; tied head filled in)."""
    out = {}
    hybrid = {f"model.{hf}": kiln for kiln, hf in hf_nemotron_h.TOP_LEVEL.items()}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq") or key.startswith("mtp."):  # mtp: Nemotron-H's extra heads
            continue
        key = hf_nemotron_h.model_key(key)
        out[hybrid.get(key) or key.removeprefix("model.")] = value
    out = hf_experts.stack_experts(out)  # per-expert weights (and Mixtral's block_sparse_moe) as Kiln holds them
    if tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    elif "lm_head.weight" not in out:
        raise StateError("the checkpoint has no lm_head.weight but its config says the embeddings are not tied")
    return out
