"""NF4: the frozen base of a QLoRA run in 4 bits (lora.quantize_base=nf4), through torchao's `NF4Tensor`.

    quantize_block(block, torch.bfloat16)   # every linear layer of a block: weight -> NF4, frozen, in place
    dequantized(weight)                     # the weight training sees (an NF4 weight's values, else itself)
    round_trip(weight, torch.bfloat16)      # what quantizing a stored weight gives back, as a plain tensor

What is quantized: the seven linear layers of every block (q, k, v, o, gate, up, down), adapted or not, as
QLoRA and bitsandbytes' `load_in_4bit` do. What is not: the embeddings and lm_head (a quarter of an 8B
model's size at a 128K vocabulary would lose the most precision per byte saved; bitsandbytes leaves lm_head
too), the norms and biases (tiny). They stay in lora.base_dtype.

The format: blocks of 64 consecutive weights (of the flattened matrix), each stored as 4-bit indices into the
16 NormalFloat levels times the block's absolute maximum; the maxima are quantized again to int8 in blocks
of 256 (double quantization). That is 0.5 + 1/64 + 4/16384 bytes a weight. An `NF4Tensor` is a tensor
subclass: `F.linear(x, w)` dequantizes `w` to x's dtype and multiplies (under torch.compile the
dequantization fuses into one kernel), and its backward gives the input's gradient only: the base is frozen.
A layer whose weight count is no multiple of 64 cannot be quantized (a ConfigError names it); the scales'
block is the largest power of two up to 256 that divides the layer's block count, so tiny test models
quantize too (real models get 256).

Quantizing is deterministic on a given device type: a run and its export quantize the stored weights the
same way. Nothing here imports torchao until a weight is quantized.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.errors import ConfigError

BLOCK = 64  # weights per quantization block (QLoRA's, bitsandbytes' and torchao's)
SCALER_BLOCK = 256  # quantized scales per block of the second quantization
# the linear layers of a block that are quantized: every one (by their module path inside a block)
LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
          # a hybrid model's layer (Nemotron-H): its mixer's, Mamba-2's projections included
          "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj", "mixer.gate_proj", "mixer.up_proj",
          "mixer.down_proj", "mixer.in_proj", "mixer.out_proj")
BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK + 4 / (BLOCK * SCALER_BLOCK)  # codes, int8 scales, a fp32 factor per 256


def torchao_nf4():
    """torchao's `to_nf4`, imported on first use (the extra kiln[qlora]); a ConfigError saying how to get it."""
    import logging

    quiet = logging.getLogger("torchao")  # it warns of every optional kernel library it cannot load
    level, quiet.level = quiet.level, logging.ERROR
    try:
        try:
            from torchao.quantization import to_nf4
        except ImportError:  # torchao before 0.16 kept it here
            from torchao.dtypes.nf4tensor import to_nf4
    except ImportError:
        raise ConfigError("lora.quantize_base=nf4 needs torchao: pip install 'kiln[qlora]' (or torchao>=0.10), "
                          "or set lora.quantize_base=none to keep the base in lora.base_dtype") from None
    except Exception as e:  # a torchao made for another torch fails inside its own import (AttributeError)
        raise ConfigError(_mismatch(e)) from None
    finally:
        quiet.setLevel(level)
    return to_nf4


def _mismatch(e: Exception) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchao")
    except PackageNotFoundError:
        found = "?"
    return (f"lora.quantize_base=nf4: torchao {found} does not load with torch {torch.__version__} "
            f"({type(e).__name__}: {e}); install the torchao release made for this torch (torchao>=0.10), or set "
            "lora.quantize_base=none to keep the base in lora.base_dtype")


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` is an NF4-quantized tensor (checked without importing torchao)."""
    return type(t).__name__ == "NF4Tensor"


def scaler_block(numel: int) -> int:
    """The second quantization's block for a layer of `numel` weights: 256, or the largest power of two that
    divides its number of 64-weight blocks (small layers)."""
    return math.gcd(numel // BLOCK, SCALER_BLOCK)


def quantize(weight: torch.Tensor, dtype: torch.dtype, name: str = "a weight") -> torch.Tensor:
    """`weight` in NF4 (an NF4Tensor on weight's device, whose dequantized values are in `dtype`)."""
    if weight.numel() % BLOCK:
        raise ConfigError(f"lora.quantize_base=nf4 cannot quantize {name}: its {weight.numel()} weights "
                          f"({list(weight.shape)}) are no multiple of the {BLOCK}-weight block; set "
                          "lora.quantize_base=none for this model")
    to_nf4 = torchao_nf4()
    return to_nf4(weight.detach().to(dtype).contiguous(), BLOCK, scaler_block(weight.numel()))


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The values an NF4 weight stands for (in its dtype), or `weight` itself when it is not quantized."""
    return weight.get_original_weight() if is_nf4(weight) else weight


def round_trip(weight: torch.Tensor, dtype: torch.dtype, name: str = "a weight") -> torch.Tensor:
    """`weight` quantized to NF4 and dequantized: the base weight a QLoRA run trains on, as a plain tensor."""
    return dequantized(quantize(weight, dtype, name))


def quantized_layers(block: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of `block` that NF4 quantizes, by path (a squared-ReLU MLP has no gate_proj)."""
    out = {}
    for path in LAYERS:
        parent, name = path.split(".")
        layer = getattr(getattr(block, parent, None), name, None)
        if layer is not None:
            out[path] = layer
    return out


@torch.no_grad()
def quantize_block(block: nn.Module, dtype: torch.dtype, where: str = "block") -> nn.Module:
    """Replace the weight of every linear layer of `block` by its NF4 form (frozen), in place, where it lives
    (quantize on the training device: it is fast there). Biases stay as they are. Returns the block."""
    for path, layer in quantized_layers(block).items():
        if is_nf4(layer.weight):
            continue
        q = quantize(layer.weight, dtype, f"{where}.{path}.weight")
        layer.weight = nn.Parameter(q, requires_grad=False)
    return block


def unshardable(model: nn.Module, parts: int) -> list[str]:
    """The NF4 weights of `model` that FSDP2 cannot split into `parts` equal shards: their rows, 4-bit codes,
    int8 scales and scale factors must each divide evenly (every real 7-8B layer does on 2, 4 or 8 GPUs)."""
    out = []
    for name, p in model.named_parameters():
        if is_nf4(p):
            sizes = (p.shape[0], p.quantized_data.numel(), p.quantized_scalers.numel(), p.quantization_factor.numel())
            if any(size % parts for size in sizes):
                out.append(name)
    return out


def param_bytes(p: torch.Tensor) -> float:
    """Bytes `p` takes: an NF4 weight's codes and scales, else its elements."""
    return p.numel() * BYTES_PER_WEIGHT if is_nf4(p) else p.numel() * p.element_size()
