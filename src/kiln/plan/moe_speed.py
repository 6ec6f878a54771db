"""The speed of a mixture of experts in the plan: the dense MFU table read at the active parameters, times a
factor measured on Kiln's own MoE runs.

Where each number comes from:

- FLOPs per token: the active parameters' (kiln.model.registry.flops_per_token: the router, the top_k routed
  experts, a shared expert, attention and the output projection) plus attention's score and value products. The
  MFU below is of those FLOPs, as the MFU meter and the benchmarks count it.
- The dense MFU (kiln.plan.gpus.estimate_mfu, with its card, AC, compile and data-parallel factors) is read at the
  ACTIVE parameters, the products a token makes, not at the total: a 5.6B MoE with 1.1B active does a 1.1B model's
  work per token.
- The MoE factor, measured MFU over that dense estimate for the same run, follows the routed rows per expert of a
  micro-batch, r = batch x seq_len x top_k / n_experts: each expert's weights are read (and under FSDP gathered)
  once a micro-batch and used for r rows, so r is the experts' arithmetic intensity; the routing (sort, scatter,
  gather of each routed row) and grouped products of a few hundred rows run far below a dense model's products.
  `POINTS` are the measured factors; between them linear in log r, beyond them the nearest one's (and the plan says
  so). H100 and H200 share the curve (the same peak; the dense table carries each card's own MFU).

Left out: moe.md's small shape on one H200 (d 512, 88M parameters, batch 1 x 2048: 0.6% MFU, its GPU busy 8.5 ms of
a 99 ms step): a step bound by the host, which the plan does not model; it plans such a model far too fast. Also its
first 20-layer run on 4 H200s (0.3% MFU: a defect of the experts' kernel, since fixed). Under expert parallelism r
is a process's own micro-batch's, as under FSDP alone; kiln.plan.experts adds its all-to-alls on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.config import ModelConfig
from kiln.plan.gpus import MfuEstimate


@dataclass(frozen=True)
class MoePoint:
    rows_per_expert: int  # batch x seq_len x top_k / n_experts of the measured micro-batch
    factor: float  # measured MFU (flops_per_token's count) / the dense estimate at the active parameters
    source: str


POINTS = (
    # one H200, 124m attention (d 768, 12 layers), batch 16 x 1024, no AC, compiled: families.md 2026-11-28 04:20
    MoePoint(4096, 0.72, "families.md: Mixtral 124m (8 experts of 2048, top 2), H200, 313,588 tokens/s, MFU 0.352"),
    MoePoint(4096, 0.61, "families.md: Qwen2-MoE 124m (16 of 512, top 4, shared 2048), H200, 267,698, MFU 0.301"),
    MoePoint(4096, 0.52, "families.md: Qwen3-MoE 124m (32 of 256, top 8), H200, 319,774, MFU 0.250"),
    # Qwen3-30B-A3B layers (128 experts of 768, top 8), batch 1 x 4096, full AC, compiled, FSDP: moe.md
    MoePoint(256, 0.17, "moe.md: 8 layers (5.6B, 1.08B active), 2 x H200, FSDP, 11,359 tokens/s a GPU, MFU 0.071"),
    MoePoint(256, 0.21, "moe.md: 20 layers (13.1B, 1.76B active), 4 x H100, FSDP, 6,758 tokens/s a GPU, MFU 0.087"),
)


def rows_per_expert(m: ModelConfig, tokens: int) -> float:
    """Routed rows each expert gets from a micro-batch of `tokens` tokens, on average (balanced routing)."""
    return tokens * m.moe.top_k / m.moe.n_experts


def factor(rows: float) -> tuple[float, bool]:
    """The MoE factor at `rows` routed rows per expert (the mean of the points measured at each r, linear in log r
    between them), and whether it is extrapolated beyond the measured r."""
    by_rows: dict[int, list[float]] = {}
    for p in POINTS:
        by_rows.setdefault(p.rows_per_expert, []).append(p.factor)
    curve = sorted((r, sum(f) / len(f)) for r, f in by_rows.items())
    if rows <= curve[0][0] or rows >= curve[-1][0]:
        end = curve[0] if rows <= curve[0][0] else curve[-1]
        return end[1], rows != end[0]
    for (r0, f0), (r1, f1) in zip(curve, curve[1:]):
        if r0 <= rows <= r1:
            t = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return f0 + t * (f1 - f0), False
    return curve[-1][1], True


def scale(est: MfuEstimate, m: ModelConfig, tokens: int) -> MfuEstimate:
    """`est` (the dense MFU at the active parameters) times the MoE factor of a micro-batch of `tokens` tokens."""
    rows = rows_per_expert(m, tokens)
    x, beyond = factor(rows)
    lo, hi = min(p.rows_per_expert for p in POINTS), max(p.rows_per_expert for p in POINTS)
    where = f"; extrapolated: measured at {lo}-{hi}" if beyond else ""
    return MfuEstimate(est.mfu * x, f"{est.basis}; mixture of experts: x{x:.2f} at {rows:,.0f} routed rows per "
                                    f"expert a micro-batch (Kiln's MoE runs, moe.md and families.md{where}; "
                                    "kiln.plan.moe_speed)")
