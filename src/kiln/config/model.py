"""`model:` the network's size and shape, or the Hugging Face model it starts from."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, model_validator

from kiln.config.base import Problem, Section
from kiln.config.moe import MoEConfig
from kiln.sizes import SIZES

LAYER_KINDS = {"M": "Mamba-2", "*": "attention", "-": "MLP"}  # the characters of model.layer_pattern


class RopeScaling(Section):
    type: Literal["llama3", "linear", "longrope"] = "llama3"
    """'llama3' (Llama 3.1: low frequencies divided by factor, a smooth band between), 'linear' (all of them), or
    'longrope' (Phi-3 128K, Phi-3.5, Phi-4-mini: each frequency divided by its own factor)."""
    factor: float = 8.0
    """How much longer the context is than the one the model was trained on."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are left as they are."""
    original_max_position_embeddings: int = 8192
    """llama3, longrope: the context length the model was first trained with."""
    short_factor: list[float] | None = None
    """longrope: the divisor of each rotary frequency for sequences up to original_max_position_embeddings."""
    long_factor: list[float] | None = None
    """longrope: the divisor of each rotary frequency for longer sequences."""
    attention_factor: float = 1.0
    """longrope: the scale of the rotary tables (Phi-3: sqrt(1 + ln(factor) / ln(original_max_position_embeddings)))."""

    def problems(self) -> list[Problem]:
        if self.type == "longrope" and (self.short_factor is None or self.long_factor is None):
            return [(("short_factor", "long_factor"), "rope_scaling.type=longrope needs short_factor and long_factor")]
        return []


class MambaConfig(Section):
    """The Mamba-2 layers of a hybrid model (model.layer_pattern 'M'; Nemotron-H): their shape and time steps."""

    heads: int | None = Field(None, ge=1)
    """Number of SSM heads; null means 2 * d_model / head_dim (Mamba-2's expansion of 2)."""
    head_dim: int = Field(64, ge=1)
    """Channels of each SSM head."""
    state: int = Field(128, ge=1)
    """Size of each head's state (Hugging Face's ssm_state_size)."""
    groups: int = Field(8, ge=1)
    """Groups of heads sharing the input-dependent B and C projections (n_groups); divides heads."""
    conv_kernel: int = Field(4, ge=1)
    """Width of the causal depthwise convolution before the scan."""
    chunk: int = Field(128, ge=1)
    """Positions per chunk of the chunked scan (a speed setting: the result does not depend on it)."""
    dt_min: float = Field(0.001, gt=0)
    """Smallest time step drawn at initialisation (log-uniform between dt_min and dt_max)."""
    dt_max: float = Field(0.1, gt=0)
    """Largest time step drawn at initialisation."""
    dt_floor: float = Field(1e-4, gt=0)
    """Time steps drawn at initialisation are at least this."""
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    """Every time step is clamped into [low, high] in the forward pass ((0, inf): no clamp)."""
    conv_bias: bool = True
    """A bias on the convolution."""
    proj_bias: bool = False
    """Biases on the input and output projections."""


class ModelConfig(Section):
    size: str | None = None
    """Named size from the registry (tiny, 124m, 350m, 1b, 3b, 8b); fields set here override it."""
    vocab_size: int | None = Field(None, ge=1, le=1 << 31)
    """Vocabulary size; null takes the tokenizer's, rounded up to a multiple of 64."""
    d_model: int = Field(256, ge=2)
    """Width of the residual stream."""
    n_layers: int = Field(4, ge=1)
    """Number of transformer blocks."""
    n_heads: int = Field(4, ge=1)
    """Number of query heads; d_model must divide evenly by it."""
    n_kv_heads: int | None = Field(None, ge=1)
    """Number of key/value heads (grouped-query attention); null means n_heads."""
    ffn_hidden: int | None = Field(None, ge=1)
    """Hidden width of the SwiGLU MLP; null means 8/3 * d_model rounded up to a multiple of 64."""
    max_seq_len: int = Field(2048, ge=1)
    """Longest sequence the model is meant for (its context, recorded in exports as max_position_embeddings).
    With init_from it is the model's own, and exports keep it: a shorter value bounds the run only, a longer one
    needs rope_scaling (the context extended on purpose, written out)."""
    rope_theta: float = Field(10000.0, gt=0)
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = Field(1e-5, gt=0, lt=1)
    """Epsilon of the RMSNorm layers."""
    tie_embeddings: bool = True
    """Share the input embedding and output projection weights."""
    init_std: float = Field(0.02, gt=0, le=1)
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    # --- options of imported architectures (Llama 3.1, Mistral, Qwen2, Qwen3, Phi-3, Nemotron); Llama's by default
    head_size: int | None = Field(None, ge=2)
    """Width of each attention head (Hugging Face's head_dim); null means d_model / n_heads."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Biases in attention: none (Llama, Mistral), on the q/k/v projections (Qwen2), or on all four."""
    mlp_bias: bool = False
    """Biases on the MLP's linear layers."""
    mlp: Literal["swiglu", "relu2", "geglu"] = "swiglu"
    """MLP: 'swiglu' (gate, up, down projections), 'relu2' (up, squared ReLU, down; Nemotron) or 'geglu' (SwiGLU's
    projections with GELU's tanh approximation for SiLU; Gemma)."""
    norm: Literal["rmsnorm", "layernorm1p", "rmsnorm1p"] = "rmsnorm"
    """Normalisation: 'rmsnorm', 'layernorm1p' (LayerNorm with bias whose scale is stored minus one; Nemotron) or
    'rmsnorm1p' (RMSNorm whose scale is stored minus one; Gemma)."""
    rotary_fraction: float = Field(1.0, gt=0, le=1)
    """Fraction of each head's dimensions that rotary embeddings rotate (the first ones; Nemotron: 0.5)."""
    rope_scaling: RopeScaling | None = None
    """Rotary frequency scaling for longer contexts (Llama 3.1 'llama3', or 'linear'); null: none."""
    sliding_window: int | None = Field(None, ge=1)
    """Each token attends to at most this many latest tokens, itself included (Mistral); null: no limit."""
    moe: MoEConfig | None = None
    """A mixture of experts in place of the MLP (see kiln.model.moe; set by init_from for Mixtral, Qwen2-MoE and
    Qwen3-MoE); null: a dense MLP."""
    qk_norm: bool = False
    """A norm (of the kind `norm` names) over each attention head's queries and keys before the rotary embedding
    (Qwen3; Gemma 3)."""
    fused_projections: bool = False
    """q, k and v computed by one qkv_proj, the MLP's gate and up by one gate_up_proj (Phi-3's layout, which
    exports as it came; lora.targets q, k, v adapt qkv_proj whole, gate and up gate_up_proj)."""
    layer_pattern: str | None = None
    """A hybrid model's layers, one character each (Nemotron-H's hybrid_override_pattern): 'M' Mamba-2, '*'
    attention (without position embeddings), '-' MLP, each a norm and its mixer on the residual; its length is
    n_layers. null: every layer attention then MLP (Llama)."""
    mamba: MambaConfig = MambaConfig()
    """Shape of the Mamba-2 layers of layer_pattern."""
    # --- Gemma 2 and 3 (each null or off: as Llama)
    sandwich_norm: bool = False
    """Norms after attention and after the MLP too, before each joins the residual stream (Gemma 2 and 3)."""
    embed_scale: bool = False
    """Multiply the input embeddings by sqrt(d_model), rounded to the compute dtype as Gemma's checkpoints were."""
    attn_scale_dim: float | None = Field(None, gt=0)
    """Attention scores are scaled by 1/sqrt(attn_scale_dim) (Gemma's query_pre_attn_scalar); null: by
    1/sqrt(head dimension)."""
    attn_softcap: float | None = Field(None, gt=0)
    """Soft-cap of attention scores, cap * tanh(score / cap) (Gemma 2's attn_logit_softcapping); null: none."""
    logit_softcap: float | None = Field(None, gt=0)
    """Soft-cap of the output logits, in the loss too (Gemma 2 and 3's final_logit_softcapping); null: none."""
    full_attention_layers: list[int] | None = None
    """With sliding_window: the layers (0-based) that attend to the whole context, the others being local (Gemma 2:
    every second layer, Gemma 3: every sixth); null: the window applies to every layer (Mistral)."""
    rope_local_theta: float | None = Field(None, gt=0)
    """Rotary base of the sliding-window layers, without rope_scaling (Gemma 3's local base); null: rope_theta."""
    hf_model_type: Literal["llama", "mistral", "qwen2", "nemotron", "mixtral", "qwen2_moe", "qwen3_moe", "qwen3",
                           "phi3", "nemotron_h", "gemma2", "gemma3_text"] | None = None
    """Hugging Face architecture that `kiln export` writes (set by init_from); null: the simplest that fits."""
    init_from: str | None = None
    """A local Hugging Face model directory (config.json + safetensors), or a Hub model id (ORG/NAME[@REVISION],
    read into huggingface_hub's cache; HF_HUB_OFFLINE=1: the cache only), whose architecture, weights and
    tokenizer the run starts from; its config sets the model fields and the context (beside it, only
    max_seq_len with rope_scaling, to extend the context on purpose)."""
    hf_class: Literal["native", "auto"] = "native"
    """'native': Kiln's own model (Llama, Mistral, Qwen2, Qwen3, Phi-3, Nemotron, Gemma 2 and 3 from init_from);
    'auto': any other causal LM of model.init_from through transformers' AutoModelForCausalLM (slower; see
    docs/huggingface.md)."""
    trust_remote_code: bool = False
    """With hf_class 'auto': let transformers run the model code shipped in the init_from directory (off by
    default, since that code runs with your permissions; turn it on only for a directory you trust)."""
    allow_pickle: bool = False
    """Let init_from load pickled weights (.bin/.pt) when it has no safetensors: loading a pickle can run code."""

    @model_validator(mode="before")
    @classmethod
    def _apply_size(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("size") is not None:
            size = data["size"]
            if size not in SIZES:
                close = difflib.get_close_matches(str(size), list(SIZES), n=1)
                hint = f" did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"unknown model size '{size}'; known: {', '.join(SIZES)}.{hint}")
            data = {**SIZES[size], **data}
        return data

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.head_size is None and self.d_model % self.n_heads:
            out.append((("d_model", "n_heads"), f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"))
        elif self.head_dim % 2:
            out.append((("d_model", "n_heads", "head_size"), f"head dimension {self.head_dim} must be even for "
                                                              "rotary embeddings"))
        elif int(self.head_dim * self.rotary_fraction) % 2:
            out.append((("rotary_fraction",), f"rotary_fraction={self.rotary_fraction} must rotate an even number "
                                              f"of the {self.head_dim} head dimensions"))
        if self.n_heads % self.kv_heads:
            out.append((("n_heads", "n_kv_heads"),
                        f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"))
        if self.moe is not None and any(i >= self.n_layers for i in self.moe.dense_layers):
            out.append((("moe", "n_layers"), f"model.moe.dense_layers={self.moe.dense_layers} names a layer beyond "
                                             f"the model's {self.n_layers}"))
        s = self.rope_scaling
        if s is not None and s.type == "longrope" and s.short_factor is not None and s.long_factor is not None:
            half = int(self.head_dim * self.rotary_fraction) // 2
            if len(s.short_factor) != half or len(s.long_factor) != half:
                out.append((("rope_scaling",), f"rope_scaling.short_factor and long_factor need one factor per rotary "
                                               f"frequency ({half}); they have {len(s.short_factor)} and "
                                               f"{len(s.long_factor)}"))
        if self.fused_projections and self.mlp != "swiglu":
            out.append((("fused_projections", "mlp"), f"fused_projections fuses the gate and up projections of a "
                                                      f"swiglu MLP; mlp={self.mlp} has no gate"))
        out += self._pattern_problems()
        if self.full_attention_layers is not None:
            if self.sliding_window is None:
                out.append((("full_attention_layers", "sliding_window"), "full_attention_layers names the layers "
                            "without a sliding window: set sliding_window too (or remove full_attention_layers)"))
            outside = [i for i in self.full_attention_layers if not 0 <= i < self.n_layers]
            if outside:
                out.append((("full_attention_layers",), f"layers {outside} are not among the model's {self.n_layers} "
                                                        f"(0 to {self.n_layers - 1})"))
        if self.hf_class == "auto" and not self.init_from:
            out.append((("hf_class", "init_from"), "model.hf_class=auto trains a Hugging Face model directory: set "
                                                   "model.init_from to it (or use hf_class native)"))
        return out

    def _pattern_problems(self) -> list[Problem]:
        if self.layer_pattern is None:
            return []
        out: list[Problem] = []
        bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
        if bad:
            moe = " (mixture-of-experts layers: train that model with model.hf_class=auto)" if "E" in bad else ""
            out.append((("layer_pattern",), f"layer_pattern has {bad}{moe}: its layers are 'M' (Mamba-2), '*' "
                                             "(attention) and '-' (MLP)"))
        if len(self.layer_pattern) != self.n_layers:
            out.append((("layer_pattern", "n_layers"), f"layer_pattern has {len(self.layer_pattern)} layers but "
                                                         f"n_layers={self.n_layers}"))
        if "M" in self.layer_pattern and self.mamba_heads % self.mamba.groups:
            out.append((("mamba",), f"mamba.groups={self.mamba.groups} does not divide the {self.mamba_heads} "
                                    "Mamba heads"))
        return out

    @property
    def mamba_heads(self) -> int:
        return self.mamba.heads or max(1, 2 * self.d_model // self.mamba.head_dim)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-int(8 * self.d_model / 3) // 64) * 64
