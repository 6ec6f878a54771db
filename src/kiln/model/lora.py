"""Low-rank adapters (LoRA) on the native model, applied from outside like parallelism.

    apply_lora(model, cfg.lora)        # freeze the base (in lora.base_dtype), add fp32 adapters in place
    adapter_state_dict(model)          # only the adapters' tensors (what a LoRA checkpoint holds)
    merge_lora(model)                  # a plain Transformer with W + (alpha / r) B A in every adapted layer

An adapted layer is a `LoraLinear`: it keeps the base layer's `weight` and `bias` under their own names,
so the base's state-dict keys do not change, and adds `lora_A.weight` (r x in, Kaiming-uniform as in
PEFT) and `lora_B.weight` (out x r, zeros: training starts from the base model exactly) beside them:

    layers.3.self_attn.q_proj.weight          the frozen base weight
    layers.3.self_attn.q_proj.lora_A.weight   adapter, trains
    layers.3.self_attn.q_proj.lora_B.weight   adapter, trains

These are PEFT's names without its `base_model.model.` prefix and Hugging Face's `model.` (see
kiln.model.lora_peft), so an adapter moves to PEFT by renaming alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import LoraConfig, ModelConfig
from kiln.errors import ConfigError
from kiln.model.lora_experts import LoraGroupedExperts, adapt_experts, merge_experts

# lora.targets -> the layer of each block it names (module path inside a Block)
TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
# a model with fused_projections (Phi-3): the layer that computes each target
FUSED = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
         "self_attn.v_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj",
         "mlp.up_proj": "mlp.gate_up_proj"}
# a hybrid model's layers (model.layer_pattern) hold one mixer each: the targets its mixers have, and the layer kind
HYBRID_TARGETS = {"q": "*", "k": "*", "v": "*", "o": "*", "gate": "-", "up": "-", "down": "-", "in_proj": "M",
                  "out_proj": "M"}
ADAPTER_MARKS = (".lora_A.", ".lora_B.")
BASE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class LoraLinear(nn.Module):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T, with W and b frozen and A, B in fp32.

    The base product runs in the base weight's dtype (or autocast's); the adapter's input is cast to the
    adapter's dtype and its output back, so a bf16 base with fp32 adapters needs no autocast."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: keys, sharing and freezing stay
        self.bias = base.bias
        self.rank, self.scaling = rank, alpha / rank
        dev = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if dev.type != "meta":
            self.reset_lora()

    @torch.no_grad()
    def reset_lora(self) -> None:
        """A as PEFT initialises it (nn.Linear's Kaiming-uniform), B zero: the adapter starts as a no-op."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        a = self.lora_A.weight
        delta = self.lora_B(self.lora_A(self.lora_dropout(x.to(a.dtype))))  # (..., out), through rank r
        return out + (delta * self.scaling).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A in fp32: what merging adds to the base weight (out x in)."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def is_adapter_key(key: str) -> bool:
    return any(mark in key for mark in ADAPTER_MARKS)


def target_layers(cfg: ModelConfig, targets: list[str]) -> list[str]:
    """The module paths inside each block that lora.targets names; ConfigError for one the model lacks."""
    known = HYBRID_TARGETS if cfg.layer_pattern else TARGETS
    names = list(known) if "all" in targets else list(dict.fromkeys(targets))
    if cfg.layer_pattern:
        return _hybrid_layers(cfg, names, "all" in targets)
    if cfg.mlp == "relu2":
        if "gate" in names and "all" not in targets:
            raise ConfigError("lora.targets names 'gate', but this model's MLP has no gate projection (squared-"
                              "ReLU MLP, as Nemotron's): choose from q, k, v, o, up, down, or 'all'")
        names = [n for n in names if n != "gate"]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ConfigError(f"lora.targets: unknown layer(s) {unknown}; choose from {sorted(TARGETS)} or 'all'")
    paths = [TARGETS[n] for n in names]
    if cfg.fused_projections:  # Phi-3: q, k, v adapt qkv_proj whole, gate and up gate_up_proj
        paths = list(dict.fromkeys(FUSED.get(p, p) for p in paths))
    return paths


def _hybrid_layers(cfg: ModelConfig, names: list[str], every: bool) -> list[str]:
    """The mixer layers a hybrid model's targets name (Mamba-2: in_proj, out_proj); with 'all', those it has."""
    unknown = [n for n in names if n not in HYBRID_TARGETS]
    if unknown:
        raise ConfigError(f"lora.targets: unknown layer(s) {unknown} for a hybrid model; choose from "
                          f"{sorted(HYBRID_TARGETS)} or 'all'")
    if cfg.mlp == "relu2":
        names = [n for n in names if n != "gate" or not every]
    absent = [n for n in names if HYBRID_TARGETS[n] not in cfg.layer_pattern or (n == "gate" and cfg.mlp == "relu2")]
    if absent and not every:
        raise ConfigError(f"lora.targets names {absent}, but no layer of this model (layer_pattern "
                          f"{cfg.layer_pattern!r}) has them: q, k, v, o are attention's ('*'), up, down the MLP's "
                          "('-'; gate only with swiglu), in_proj, out_proj Mamba-2's ('M')")
    return [f"mixer.{TARGETS[n].split('.')[1] if n in TARGETS else n}" for n in names if n not in absent]


def hf_target_modules(cfg: ModelConfig, targets: list[str]) -> list[str]:
    """The Hugging Face module names of the adapted layers (q_proj, ...), as PEFT's target_modules."""
    return sorted(path.rsplit(".", 1)[1] for path in target_layers(cfg, targets))


def apply_lora(model: nn.Module, lcfg: LoraConfig) -> nn.Module:
    """Freeze every parameter of `model` (a Transformer), cast it to lora.base_dtype, and put a fp32
    adapter on each targeted linear layer of every block, in place. A no-op when lora.rank is 0.

    Adapters are initialised from torch's global generator (seed it for a reproducible start)."""
    if lcfg.rank == 0:
        return model
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise RuntimeError("LoRA is already applied to this model")
    paths = target_layers(model.cfg, lcfg.targets)
    dtype = BASE_DTYPES[lcfg.base_dtype]
    with torch.no_grad():
        for p in model.parameters():  # tied embeddings are one Parameter: cast once, still tied
            p.requires_grad_(False)
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    for block in model.layers:
        # a mixture of experts' MLP (a hybrid model's layers have a mixer instead)
        experts = adapt_experts(block, paths, lcfg.rank, lcfg.alpha, lcfg.dropout) if hasattr(block, "mlp") else []
        for path in paths:
            parent_name, name = path.split(".")
            parent = getattr(block, parent_name)
            if path in experts:  # and its shared expert's layer (Qwen2-MoE), where it has one
                parent = getattr(parent, "shared_expert", None)
            if isinstance(getattr(parent, name, None), nn.Linear):  # a hybrid model's layers each have some
                setattr(parent, name, LoraLinear(getattr(parent, name), lcfg.rank, lcfg.alpha, lcfg.dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors of `model` under their state-dict keys (empty without LoRA)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def merge_state_dict(state: dict[str, torch.Tensor], lcfg: LoraConfig) -> dict[str, torch.Tensor]:
    """A plain model's state dict from a LoRA model's (base + adapters): every floating-point tensor in
    fp32, each adapted weight plus (alpha / r) B A, the adapter keys dropped."""
    scale = lcfg.alpha / lcfg.rank
    state = merge_experts(state, scale)  # a mixture of experts' stacked adapters (kiln.model.lora_experts)
    out = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items() if not is_adapter_key(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            prefix = key.removesuffix(".lora_A.weight")
            a, b = state[key].float(), state[f"{prefix}.lora_B.weight"].float()
            out[f"{prefix}.weight"] = out[f"{prefix}.weight"] + scale * (b @ a)
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """A new plain `Transformer` (fp32, on the model's device) whose weights are the LoRA model's merged (an NF4
    base dequantized: the QLoRA model in fp32); `model` itself is unchanged. A model without adapters is returned
    as it is."""
    from kiln.model.llama import Transformer

    layers = lora_layers(model)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, LoraGroupedExperts)}
    if not layers and not experts:
        return model
    device = (next(iter(layers.values())).weight if layers else next(iter(experts.values())).down_proj).device
    from kiln.model.quant import dequantized

    state = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
    for name, stacked in experts.items():  # each expert's adapters merged into its rows
        state.update({f"{name}.{k}": v for k, v in stacked.merged().state_dict().items()})
    state = {k: (dequantized(v).float() if v.is_floating_point() else v) for k, v in state.items()}  # NF4: values
    for name, layer in layers.items():
        state[f"{name}.weight"] = state[f"{name}.weight"] + layer.delta_weight().to(state[f"{name}.weight"].device)
    with torch.device("meta"):
        plain = Transformer(model.cfg)
    plain.to_empty(device=device)
    plain.init_weights()  # re-ties embeddings and builds the rope tables; the weights come next
    plain.load_state_dict(state)
    return plain.train(model.training)


def trainable_summary(model: nn.Module, lcfg: LoraConfig) -> str:
    """'LoRA r=8 (alpha 16) on q, v: 70,656 trainable of 12,345,678 parameters (0.57%), base frozen in bf16'."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    base = (f"the blocks' linear layers in NF4 (QLoRA), the rest in {lcfg.base_dtype}"
            if lcfg.quantize_base == "nf4" else lcfg.base_dtype)
    where = ", ".join(lcfg.targets)
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "fused_projections", False):  # Phi-3: say which layers, and that a fused one is adapted whole
        where += f" (layers {', '.join(hf_target_modules(cfg, lcfg.targets))}: a fused one adapted whole)"
    return (f"LoRA r={lcfg.rank} (alpha {lcfg.alpha:g}) on {where}: {trainable:,} "
            f"trainable of {total:,} parameters ({100 * trainable / max(1, total):.2f}%), base frozen in {base}")


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad)


def training_bytes(model: nn.Module) -> int:
    """Bytes of weights, gradients and AdamW moments: the frozen weights as stored (NF4 ones at their 4 bits and
    scales), 16 per trainable parameter."""
    from kiln.model.quant import param_bytes

    params = {id(p): p for p in model.parameters()}.values()
    return int(sum(p.numel() * 16 if p.requires_grad else param_bytes(p) for p in params))


def lora_flops_per_token(full: float, cfg: ModelConfig, seq_len: int, trainable: int) -> float:
    """Training FLOPs per token with a frozen base, from the full model's `full` (6 N + attention): the base's
    weight gradients (2 N) are not computed, the adapters' 6 r (in + out) per layer are."""
    from kiln.model.registry import sequence_flops

    n = (full - sequence_flops(cfg, seq_len)) / 6.0  # the parameters that do matrix products
    return full - 2.0 * n + 6.0 * trainable

