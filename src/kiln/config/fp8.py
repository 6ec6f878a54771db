"""`train.fp8:` float8 training of the transformer blocks' linear layers (kiln.parallel.float8, on torchao)."""

from __future__ import annotations

from typing import Literal

from kiln.config.base import Section


class Fp8Config(Section):
    """Float8 matrix products in the blocks' linear layers (torchao's float8 training), on GPUs with fp8 tensor
    cores (compute capability 8.9 or more: H100, H200, L4, L40S, B200; not A100, not the CPU). Each converted
    layer keeps its fp32 weight (checkpoints and exports are unchanged) and casts it and its input to float8
    for the product, with a scale per tensor or per row. Stay in bf16: the output layer (lm_head) and the
    embeddings (not blocks' layers, and the most sensitive to rounding), the norms, attention's softmax and the
    loss (not linear layers), routers of a mixture of experts (tiny, and their choice is fragile), and any
    linear layer whose input or output size is not a multiple of 16 (float8 tensor cores need it). The rest of
    the model runs in bf16, as train.precision=bf16."""

    enabled: bool = False
    """Train the blocks' linear layers in float8 (needs train.precision bf16 or auto, a CUDA GPU with fp8, and
    torchao: pip install 'kiln[fp8]')."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling of the float8 casts: 'tensorwise' (one scale per tensor, the cheapest casts; under FSDP the
    weights are gathered in float8, half the bytes of bf16) or 'rowwise' (a scale per row of each operand: closer
    to bf16 where a few outliers would crush a whole tensor's range; weights gathered in bf16).
    benchmarks/fp8.py measures both against bf16."""
    all_gather: bool = True
    """Under FSDP with the tensorwise recipe: gather the converted weights in float8 (their scales computed for
    all of them at once after each optimizer step); false gathers them in bf16."""
    skip: list[str] = []
    """Linear layers kept in bf16 besides those above: a layer whose name (as in the state dict, e.g.
    'layers.0.self_attn.q_proj', or '.k_proj' for every block's) contains one of these strings."""
