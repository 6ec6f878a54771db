"""The chunked loss's gradient of the output projection: summed in fp32, handed back in the weight's own memory.

The forward pass of `kiln.model.loss.linear_cross_entropy` sums the projection's (V, d) gradient in fp32 over its
chunks (`zeros`, `add_rows`); its backward pass scales that sum by the loss's upstream gradient over the counted
positions and returns it in the weight's dtype (`scaled`). Made naively, the returned gradient is a second (V, d)
buffer beside the fp32 one at the moment of the loss's backward: 2 GB more in bf16 at a 256K vocabulary and
d = 4096, which decides whether an 8B model with its optimizer offloaded fits a 24 GB card. So:

- an fp32 weight (the sum's own dtype) gets the sum itself, scaled in place;
- a narrower weight (bf16, fp16: k = 2 or more of its elements to an fp32 one) gets its gradient written over the
  bytes of the sum. The sum is kept as two blocks of rows, the first of ceil(V / k) rows, exactly large enough to
  hold the whole narrow gradient. Rows are scaled in place and copied down to their narrow place in order: rows
  [a, b) land on bytes the first a fp32 rows held, already converted, whenever b <= k a, so after the first row
  (through a one-row temporary) the first block goes in doubling runs, then the second block, which is freed when
  autograd drops it. The gradient autograd keeps as `.grad` owns the first block's memory (V d bytes in bf16 under
  k = 2: no larger than a gradient of its own) and is contiguous, at offset 0;
- a wider weight (fp64 under an fp32 computation) gets a buffer of its own, made a slice of rows at a time.

Each element is the one `(sum * scale).to(weight dtype)` gives: bit for bit what a separate buffer would hold. The
sum is spent by the conversion, so the loss's backward runs once per forward (no `retain_graph`).
"""

from __future__ import annotations

import torch

# rows of the gradient scaled at a time where a separate buffer is made (kiln.plan.offload copies it)
VOCAB_SLICE = 8192


def zeros(shape: torch.Size, acc: torch.dtype, weight_dtype: torch.dtype, device: torch.device
          ) -> list[torch.Tensor]:
    """The (V, d) sum in dtype `acc`, zeroed, as row blocks: two where the weight's dtype is narrower by a whole
    factor (the first of ceil(V / k) rows, to hold the returned gradient), else one."""
    v, d = shape
    k = acc.itemsize // weight_dtype.itemsize
    if k < 2 or acc.itemsize % weight_dtype.itemsize:
        return [torch.zeros((v, d), device=device, dtype=acc)]
    first = -(-v // k)
    return [torch.zeros((first, d), device=device, dtype=acc), torch.zeros((v - first, d), device=device, dtype=acc)]


def add_rows(blocks: list[torch.Tensor], start: int, part: torch.Tensor) -> None:
    """Add `part`, the gradient's rows [start, start + len(part)), to the blocks that hold them."""
    at = 0
    for block in blocks:
        lo, hi = max(start, at), min(start + part.shape[0], at + block.shape[0])
        if lo < hi:
            block[lo - at:hi - at] += part[lo - start:hi - start]
        at += block.shape[0]


def scaled(blocks: list[torch.Tensor], scale: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """The whole gradient, `sum * scale` in `weight_dtype`, made in the blocks' memory where it fits (module doc).
    Spends the blocks."""
    if len(blocks) == 1:
        (acc,) = blocks
        if acc.dtype == weight_dtype:
            return acc.mul_(scale)
        out = torch.empty(acc.shape, device=acc.device, dtype=weight_dtype)
        for v in range(0, acc.shape[0], VOCAB_SLICE):
            out[v:v + VOCAB_SLICE] = acc[v:v + VOCAB_SLICE] * scale
        return out
    first, rest = blocks
    m, d = first.shape
    out = torch.empty(0, device=first.device, dtype=weight_dtype)
    out.set_(first.untyped_storage(), 0, (m + rest.shape[0], d))  # (V, d) over the first block's bytes
    if m:
        out[:1] = first[:1] * scale  # lands on the row it is read from: through a temporary
    a = 1
    while a < m:  # rows [a, b) land on bytes of fp32 rows below a, all converted already: b <= 2a
        b = min(2 * a, a + VOCAB_SLICE, m)
        out[a:b] = first[a:b].mul_(scale)
        a = b
    for v in range(0, rest.shape[0], VOCAB_SLICE):  # onto the first block's bytes, all converted
        out[m + v:m + v + VOCAB_SLICE] = rest[v:v + VOCAB_SLICE].mul_(scale)
    return out
