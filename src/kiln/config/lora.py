"""`lora:` low-rank adapters on a frozen base model (kiln.model.lora)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from kiln.config.base import Problem, Section
from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.config.model import ModelConfig

# lora.targets may name a layer as Hugging Face models do: read as the targets it computes
HF_TARGETS = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("gate",),
              "up_proj": ("up",), "down_proj": ("down",), "qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up"),
              "w1": ("gate",), "w3": ("up",), "w2": ("down",)}  # the last three: Mixtral's experts


class LoraConfig(Section):
    """Low-rank adapters: the base model is frozen and only small matrices A (r x in) and B (out x r)
    train, added to the chosen linear layers as W x + (alpha / r) * B A dropout(x)."""

    rank: int = Field(0, ge=0)
    """Rank r of each adapter (0: LoRA off, every weight trains)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""
    targets: list[str] = ["q", "k", "v", "o"]
    """Layers that get adapters: any of q, k, v, o (attention), gate, up, down (MLP) and in_proj, out_proj (the
    Mamba-2 layers of a hybrid model); 'all' for every one the model has. Hugging Face's layer names are read as
    the targets they compute (q_proj as q, ..., Phi-3's qkv_proj as q, k, v and gate_up_proj as gate, up, Mixtral's
    w1, w3, w2 as gate, up, down). A
    target the model has no layer for is an error; a fused projection (Phi-3's qkv_proj, gate_up_proj) is adapted
    whole for any target it computes. In a mixture of experts gate, up and down give every expert an adapter of its
    own (stacked over the experts)."""
    base_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the frozen base weights (bf16 halves their memory; the adapters train in fp32)."""
    quantize_base: Literal["none", "nf4"] = "none"
    """QLoRA: 'nf4' stores the frozen base's linear layers (q, k, v, o, gate, up, down of every block, adapted or
    not) in 4-bit NormalFloat, blocks of 64 weights with double-quantized scales (about 0.52 bytes a weight):
    an 8B base takes 5.6 GB instead of 16. The embeddings, norms and lm_head stay in lora.base_dtype; the adapters
    train in fp32 and compute in bf16 under autocast. The base is quantized on the training device a block at a
    time as it loads; the merged export is the adapters on the dequantized base, the model that was trained.
    Needs torchao: pip install 'kiln[qlora]'. The native model only (not model.hf_class=auto)."""

    @field_validator("targets")
    @classmethod
    def _kiln_names(cls, targets: list[str]) -> list[str]:
        return list(dict.fromkeys(t for name in targets for t in HF_TARGETS.get(name, (name,))))

    def problems(self) -> list[Problem]:
        known = {"q", "k", "v", "o", "gate", "up", "down", "in_proj", "out_proj", "all"}
        bad = [t for t in self.targets if t not in known]
        if bad:
            return [(("targets",), f"unknown LoRA target(s) {bad}; choose from {sorted(known)} (or Hugging Face's "
                                   f"names: {', '.join(HF_TARGETS)})")]
        if self.rank and not self.targets:
            return [(("targets",), "lora.targets is empty: name the layers that get adapters")]
        if self.quantize_base != "none" and not self.rank:
            return [(("quantize_base", "rank"), f"lora.quantize_base={self.quantize_base} quantizes the frozen base "
                     "of a LoRA run, but lora.rank is 0 (every weight trains): set lora.rank (e.g. 16), or "
                     "lora.quantize_base=none")]
        return []

    def require_base(self, model: ModelConfig) -> None:
        """A ConfigError for LoRA without a base model to adapt (model.init_from), said when training starts (the
        config itself may lack one: `kiln plan` sizes LoRA on a model shape alone)."""
        if self.rank and not model.init_from:
            raise ConfigError("lora.rank is set but model.init_from is not: LoRA adapts a trained base model; set "
                              "model.init_from to its Hugging Face directory, or lora.rank=0 to train every weight")
