"""The Triton program of `kiln.model.loss_triton`: imports triton, so only that module imports it, when used.

One program per row of logits. A first pass over the row, a block of the vocabulary at a time, keeps a running
maximum and sum of exponentials in fp32 (the log-sum-exp); a second pass writes the logits' gradient, softmax
minus one-hot, in the logits' dtype (over the logits themselves when the caller allows). Memory traffic: the row
read twice and written once. A row whose target is the ignore index gets a zero loss and a zero gradient without
being read.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _capped(x, softcap, SOFTCAP: tl.constexpr):
    """softcap * tanh(x / softcap) in fp32 (x itself without SOFTCAP): tanh from one exponential of -2|y|,
    which never overflows; libdevice's tanh would not run under Triton's interpreter."""
    if SOFTCAP:
        y = x / softcap
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        x = softcap * tl.where(y < 0, -t, t)
    return x


@triton.jit
def cross_entropy_rows(logits_ptr, grad_ptr, targets_ptr, loss_ptr, n_cols, logits_stride, grad_stride,
                       softcap, ignore_index, SOFTCAP: tl.constexpr, WANT_GRAD: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_stride
    grad_ptr += row * grad_stride
    target = tl.load(targets_ptr + row)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WANT_GRAD:
            zero = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
            for start in range(0, n_cols, BLOCK):
                idx = start + cols
                tl.store(grad_ptr + idx, zero, mask=idx < n_cols)
    else:
        # the target's logit, read before pass 1: pass 1 ends in a reduction every warp of the program waits
        # for, so no warp can yet have written a gradient over it (in place), as one could after pass 1
        # a target outside the vocabulary reads nothing and makes the loss NaN (eager PyTorch raises instead)
        known = (target >= 0) & (target < n_cols)
        x_target = tl.load(logits_ptr + tl.where(known, target, 0)).to(tl.float32)
        x_target = _capped(x_target, softcap, SOFTCAP)
        # pass 1: the row's log-sum-exp, online (running maximum m, sum s of exp(x - m)), in fp32
        m = -float("inf")
        s = 0.0
        for start in range(0, n_cols, BLOCK):
            idx = start + cols
            inside = idx < n_cols
            x = _capped(tl.load(logits_ptr + idx, mask=inside, other=0.0).to(tl.float32), softcap, SOFTCAP)
            x = tl.where(inside, x, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(loss_ptr + row, tl.where(known, lse - x_target, float("nan")))
        if WANT_GRAD:  # pass 2: softmax - one-hot, times the cap's derivative 1 - tanh^2; each thread stores
            # what it loaded (one layout), so writing over the logits reads nothing already written
            for start in range(0, n_cols, BLOCK):
                idx = start + cols
                inside = idx < n_cols
                x = _capped(tl.load(logits_ptr + idx, mask=inside, other=0.0).to(tl.float32), softcap, SOFTCAP)
                g = tl.exp(x - lse) - tl.where(idx == target, 1.0, 0.0)
                if SOFTCAP:
                    r = x / softcap
                    g = g * (1.0 - r * r)
                tl.store(grad_ptr + idx, g.to(grad_ptr.dtype.element_ty), mask=inside)
