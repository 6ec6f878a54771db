"""What float8 training (train.fp8) changes in a plan: speed and the memory of the weights' compute copies.

Speed. A step's time splits into the float8-converted matrix products (the blocks' linear layers) and the
rest (the output layer, attention, norms, elementwise ops, communication left exposed). The converted products'
share of the step's time is their share of the model FLOPs times the run's MFU over the efficiency of a large
bf16 product (GEMM_EFFICIENCY of the bf16 peak): at 50% MFU a product that reaches 80% of the peak fills 5/8
of the time its FLOPs would. Float8 makes that share FP8_GEMM_SPEEDUP times faster, casts included:

    fp8 time / bf16 time = 1 - s + s / FP8_GEMM_SPEEDUP,   s = converted FLOPs share x MFU / GEMM_EFFICIENCY

FP8_GEMM_SPEEDUP = 1.6 is below the 2x of the tensor cores' peaks: torchao's float8 linear layers (product,
dynamic scales and casts, forward and backward) measure 1.5-1.9x over bf16 on an H100 at the shapes of 1B-8B
models (larger products gain more); an estimate until benchmarks/fp8.py measures Kiln's own.

Memory. A converted layer keeps its fp32 weight, gradient and AdamW moments, and saves the same bf16 input for
its backward pass, so weights, optimizer state and activations do not change. What changes: its compute copy is
float8 (1 byte) where autocast would have cached a bf16 copy (eager runs), and under FSDP with float8 gathers
(tensorwise) its gathered weight is 1 byte a parameter instead of 2.
"""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.model.registry import flops_per_token

FP8_GEMM_SPEEDUP = 1.6  # a float8 linear layer's product with its casts, over bf16, at 1B-8B shapes (H100)
GEMM_EFFICIENCY = 0.8  # of the bf16 peak a large bf16 product reaches on H100/H200 (the practical ceiling)
# cards with float8 tensor cores (compute capability 8.9 or more) among kiln.plan.gpus.GPUS
FP8_GPUS = {"h100", "h200", "l40s", "rtx4090", "l4"}


def converted_params(m: ModelConfig) -> int:
    """Parameters per block (the mean over blocks) in linear layers train.fp8 converts: those with both sizes
    multiples of 16. A mixture of experts keeps its router and experts in bf16: its blocks count attention, the
    shared expert and the dense layers' MLPs."""
    d, q, kv = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim

    def mlp(h: int) -> list[tuple[int, int]]:
        return [(d, h), (h, d)] + ([(d, h)] if m.mlp == "swiglu" else [])

    def params(shapes: list[tuple[int, int]]) -> int:
        return sum(a * b for a, b in shapes if a % 16 == 0 and b % 16 == 0)

    attn = params([(d, q), (d, kv), (d, kv), (q, d)])
    if m.moe is None:
        return attn + params(mlp(m.mlp_hidden))
    dense = len(m.moe.dense_layers)
    shared = params(mlp(m.moe.shared_expert_hidden)) if m.moe.shared_expert_hidden else 0
    total = m.n_layers * attn + dense * params(mlp(m.mlp_hidden)) + (m.n_layers - dense) * shared
    return total // m.n_layers


def converted_share(m: ModelConfig, seq_len: int) -> float:
    """Share of the model FLOPs per token in the converted products (6 per parameter and token)."""
    return 6.0 * m.n_layers * converted_params(m) / flops_per_token(m, seq_len)


def speedup(m: ModelConfig, seq_len: int, mfu: float) -> float:
    """bf16 step time over fp8 step time, for a run at `mfu` (model FLOPs over the bf16 peak) in bf16."""
    s = min(1.0, converted_share(m, seq_len) * mfu / GEMM_EFFICIENCY)
    return 1.0 / (1.0 - s + s / FP8_GEMM_SPEEDUP)
