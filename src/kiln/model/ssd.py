"""Mamba-2's selective scan in its chunked, state-space-dual (SSD) form, in plain PyTorch.

    y = ssd_scan(x, dt, A, B, C, chunk, docs)

For every head h (of H, in G groups sharing B and C) and position t, with a state S_t of shape (P, N):

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T          y_t = S_t C_t

and S is zero before the first position of each document of `docs` (the decay across a document boundary
is zero). The sequence is cut into chunks of `chunk` positions:

1. inside a chunk the outputs are a masked quadratic form, like causal attention: y = ((C B^T) * decay) x dt,
   decay[l, s] = exp(sum of dt A over s < k <= l) for s <= l in the same document, else 0;
2. each chunk's contribution to the state at its end is one product with B;
3. the states pass from chunk to chunk through their cumulative decays: a small quadratic form over chunks
   (segment sums, masked where the chunks' ends lie in different documents);
4. each position reads the state its chunk started with through C, decayed to it.

No data-dependent Python control flow: one graph for every input of a shape, so `torch.compile` takes it
whole inside a block (kiln.parallel.compile), which is the GPU path; eager, it is the CPU path. Precision
follows the fused Mamba-2 kernels: decays and states in fp32, the two large products (C B^T with its decays
times x; C times the incoming states) in the inputs' dtype with the result accumulated in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a (..., n) -> (..., n, n): out[i, j] = a[j+1] + ... + a[i] for j <= i (0 on the diagonal), -inf above.
    Summed by a masked cumulative sum, not as a difference of two prefix sums, so no precision is lost."""
    n = a.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)  # k > j
    terms = a[..., :, None].expand(*a.shape, n).masked_fill(~lower, 0.0)  # terms[k, j] = a[k] where k > j
    sums = terms.cumsum(dim=-2)  # sums[i, j] = sum of a[k] for j < k <= i
    return sums.masked_fill(~lower.logical_or(torch.eye(n, dtype=torch.bool, device=a.device)), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int,
             docs: torch.Tensor | None = None) -> torch.Tensor:
    """x (b, T, H, P); dt (b, T, H) time steps (>= 0); A (H,) negative rates; B, C (b, T, G, N); docs (b, T) the
    document of each position (consecutive positions of a document are contiguous) or None: one document.
    Returns y (b, T, H, P) in fp32 (without Mamba-2's D skip, which the layer adds)."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    R = H // G  # heads per group
    L = min(chunk, T)
    pad = -T % L
    if pad:  # zero steps at the end: no input, no decay; their outputs are cut off below
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
        docs = None if docs is None else F.pad(docs, (0, pad), value=-1)
    c = (T + pad) // L
    dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
        dA = (dt.float() * A.float()).view(b, c, L, G, R)  # log decay of each step (<= 0)
        xdt = (x.float() * dt.float()[..., None]).view(b, c, L, G, R, P)
        Bc, Cc = B.view(b, c, L, G, N), C.view(b, c, L, G, N)
        cum = dA.cumsum(dim=2)  # (b, c, L, G, R): log decay from the chunk's start to each position
        d = None if docs is None else docs.view(b, c, L)

        # 1. inside each chunk: (C B^T) * decay, times x dt
        cum_h = cum.permute(0, 1, 3, 4, 2)  # (b, c, G, R, L)
        keep = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # (l, s): s <= l
        if d is not None:
            keep = keep & (d[:, :, :, None] == d[:, :, None, :])[:, :, None, None]  # (b, c, 1, 1, L, L)
        log_decay = (cum_h[..., :, None] - cum_h[..., None, :]).masked_fill(~keep, float("-inf"))
        scores = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)  # (b, c, G, L, L), shared by the group's heads
        mixed = (scores.float()[:, :, :, None] * torch.exp(log_decay)).to(dtype)  # (b, c, G, R, L, L)
        y = torch.einsum("bcgrls,bcsgrp->bclgrp", mixed, xdt.to(dtype)).float()

        # 2. what each chunk adds to the state at its end (fp32)
        to_end = torch.exp(cum[:, :, -1:] - cum)  # (b, c, L, G, R)
        if d is not None:
            to_end = to_end * (d == d[:, :, -1:])[..., None, None]
        states = torch.einsum("bclgrp,bclgn->bcgrpn", xdt * to_end[..., None], Bc.float())  # (b, c, G, R, P, N)

        # 3. the state each chunk starts with (the one the chunk before ends with): every earlier chunk's
        # contribution, decayed across the chunks between
        totals = cum[:, :, -1].permute(0, 2, 3, 1)  # (b, G, R, c): each chunk's whole log decay
        across = segment_sums(totals)  # (b, G, R, c, z): from the end of chunk z to the end of chunk c
        if d is not None:
            ends = d[:, :, -1]  # (b, c)
            across = across.masked_fill(~(ends[:, :, None] == ends[:, None, :])[:, None, None], float("-inf"))
        # row c - 1 for chunk c (shifted on this small matrix, not on the states); the first chunk starts from zero
        across = F.pad(across[..., :-1, :], (0, 0, 1, 0), value=float("-inf"))
        start = torch.einsum("bgrcz,bzgrpn->bcgrpn", torch.exp(across), states)  # (b, c, G, R, P, N)

        # 4. each position reads its chunk's starting state through C, decayed from the chunk's start
        from_start = torch.exp(cum)  # (b, c, L, G, R)
        if d is not None:
            before = torch.cat([torch.full_like(d[:, :1, -1], -2), d[:, :-1, -1]], dim=1)  # (b, c)
            from_start = from_start * (d == before[:, :, None])[..., None, None]
        y_off = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, start.to(dtype)).float() * from_start[..., None]
        y = (y + y_off).reshape(b, c * L, H, P)
    return y[:, :T]

