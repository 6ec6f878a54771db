"""Cross-entropy over the vocabulary without ever holding the whole batch's logits.

`linear_cross_entropy(h, weight, targets)` equals
`F.cross_entropy(h @ weight.T, targets, ignore_index=-100)` (mean over counted positions), but works
through the rows in chunks: for each chunk it computes the logits, the loss and, when gradients are
wanted, the gradients with respect to `h` and `weight`, then drops the logits. Peak extra memory is one
chunk of logits instead of (B*T, V) logits in fp32 plus their gradient, which for a 32K vocabulary
at 32K tokens a step is 8 GiB saved. The backward pass only rescales the stored gradients, the output
projection's in the memory of its fp32 sum, which it hands back as the weight's gradient
(`kiln.model.loss_weight_grad`: no second (V, d) buffer at the loss's backward). Only the gradients wanted are
made: a frozen output projection (LoRA and QLoRA, whose base includes lm_head) gets no (V, d) fp32 sum and no
product for it (2 GiB and a third of the loss's matrix products at a 128K vocabulary and d = 4096), frozen
hidden states (only the head trained) no (n, d) gradient; the loss and the gradients made are bit for bit the same.

Under autocast the two matrix products run in the autocast dtype (as `nn.Linear` would) while the
softmax is always computed in fp32. Soft-capped logits (Gemma: `softcap`, cap * tanh(logits / cap)) are
capped there too, and their gradient carries the cap's derivative. The elementwise part is a plain function
(`chunk_loss_and_grad`) that `kiln.parallel.compile` may replace with a compiled, fused version.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.model import loss_weight_grad
from kiln.model.loss_weight_grad import VOCAB_SLICE

IGNORE_INDEX = -100
# elements of one chunk of logits: 2**28 (0.5 GiB in bf16) keeps the matrix products large enough
# to run at full rate while the memory they need stays small next to the model's
CHUNK_ELEMENTS = 2**28
# VOCAB_SLICE: rows of the output projection's gradient made at a time: a (V, d) temporary beside the fp32
# gradient would be 2 GB more at a 256K vocabulary (Nemotron), 0.3% of an H100's time in slices of this size


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, want_grad: bool, softcap: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits (n, V), targets (n,) -> (summed loss in fp32, d(sum loss)/d(logits) in logits' dtype or None);
    softcap: the loss of cap * tanh(logits / cap) instead (None: of the logits)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays fp64)
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    valid = targets != IGNORE_INDEX  # (n,)
    safe = torch.where(valid, targets, 0).unsqueeze(1)  # (n, 1)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (n, 1)
    loss = ((lse - x.gather(1, safe)).squeeze(1) * valid).sum()
    if not want_grad:
        return loss, None
    onehot = torch.zeros_like(x).scatter_(1, safe, 1.0)
    grad = (torch.exp(x - lse) - onehot) * valid.unsqueeze(1)  # (n, V): softmax minus one-hot
    if softcap is not None:  # through the cap: d(c tanh(l / c))/dl = 1 - tanh^2
        grad = grad * (1 - torch.square(x / softcap))
    return loss, grad.to(logits.dtype)


class ChunkKernel:
    """The elementwise kernel used by every chunk; `kiln.parallel.compile` swaps in a compiled one,
    `kiln.parallel.loss_kernel` a Triton one. The logits it is given are the chunk's own temporary: it may
    write their gradient over them."""

    fn: Callable = staticmethod(chunk_loss_and_grad)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def chunk_rows(n_rows: int, vocab: int) -> int:
    """Rows per chunk: about CHUNK_ELEMENTS logits, a multiple of 256 rows, at least 256."""
    rows = max(256, (CHUNK_ELEMENTS // max(vocab, 1)) // 256 * 256)
    return min(rows, n_rows) if n_rows else 1


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                rows: int, want_h: bool, want_w: bool, softcap: float | None) -> torch.Tensor:
        n = h.shape[0]
        w = weight.to(dtype)  # (V, d)
        acc = torch.promote_types(dtype, torch.float32)
        loss = torch.zeros((), device=h.device, dtype=acc)
        want_grad = want_h or want_w  # the logits' gradient, from which both are made
        grad_h = torch.empty_like(h) if want_h else None  # (n, d)
        # the (V, d) sum in fp32, in row blocks the backward pass can return it in (kiln.model.loss_weight_grad);
        # none for a frozen weight
        grad_w = loss_weight_grad.zeros(weight.shape, acc, weight.dtype, weight.device) if want_w else []
        kernel = ChunkKernel.fn
        for s in range(0, n, rows):
            hc = h[s:s + rows].to(dtype)  # (r, d)
            part, g = kernel(hc @ w.t(), targets[s:s + rows], want_grad, softcap)  # g: (r, V)
            loss += part
            if want_h:
                grad_h[s:s + rows] = g @ w
            if want_w:
                for v in range(0, w.shape[0], VOCAB_SLICE):  # in slices of the vocabulary: no (V, d) temporary
                    loss_weight_grad.add_rows(grad_w, v, g[:, v:v + VOCAB_SLICE].t() @ hc)
            del g  # before the next chunk's logits exist: one chunk's worth of memory at a time
        count = (targets != IGNORE_INDEX).sum().to(acc)
        ctx.save_for_backward(grad_h, count, *grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.spent = False
        return loss / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.spent and ctx.needs_input_grad[1]:
            raise RuntimeError("the chunked cross-entropy's backward runs once per forward pass: it hands back the "
                               "output projection's gradient in the memory of its sum (retain_graph is not "
                               "supported; compute the loss again)")
        ctx.spent = True
        grad_h, count, *grad_w = ctx.saved_tensors
        scale = grad_out.to(count.dtype) / count
        gh = (grad_h * scale).to(grad_h.dtype) if ctx.needs_input_grad[0] and grad_h is not None else None
        # scaled in place, and in a narrower weight dtype written over the fp32 sum's own bytes: no second (V, d)
        gw = loss_weight_grad.scaled(grad_w, scale, ctx.weight_dtype) if ctx.needs_input_grad[1] and grad_w else None
        del grad_w
        return gh, gw, None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         rows: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight.T` (soft-capped by `softcap`, if given) against `targets`,
    skipping targets of -100.

    h: (..., d) hidden states; weight: (V, d) output projection; targets: (...) token ids.
    A batch whose targets are all -100 gives NaN, as `F.cross_entropy` does. A model compiled whole runs it
    outside its graph (`kiln.parallel.compile`): a loop of large kernels around a compiled one, nothing to fuse.
    """
    h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    grad = torch.is_grad_enabled()
    want_h, want_w = grad and h.requires_grad, grad and weight.requires_grad  # a frozen one gets no gradient made
    rows = rows or chunk_rows(h2.shape[0], weight.shape[0])
    return _LinearCrossEntropy.apply(h2, weight, t, _compute_dtype(h2), rows, want_h, want_w, softcap)
