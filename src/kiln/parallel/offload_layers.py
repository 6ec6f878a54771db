"""The offloaded step layer by layer: every micro-batch through one layer before the next (train.offload=optimizer).

With the gradient sums in host memory (kiln.parallel.offload), a step that runs its micro-batches one after the
other copies every fp32 sum up and back for each micro-batch after the first: 8 bytes a parameter a micro-batch
over PCIe, more than the GPU's arithmetic takes at 8B. This schedule runs the step's micro-batches together, one
layer at a time, so that each layer's sums stay on the device until its last micro-batch has passed:

    forward    without autograd, layer by layer; each layer's input of every micro-batch is kept (in page-locked
               host memory on a GPU: 2 bytes x layers x rows x seq_len x d_model, 8.6 GB at 8B and 8 x 4096)
    head       each micro-batch's loss, its gradient with respect to the last hidden states, and the final norm's
               and output layer's gradients
    backward   layer by layer from the last: each micro-batch's layer run again from its kept input, with autograd,
               its input's gradient carried to the layer below and its parameters' gradients summed in fp32 on the
               device; once every micro-batch has passed, the sums go down to host memory, once a step
    embedding  its gradient from each micro-batch's first input gradient

A large step runs in waves of WAVE_TOKENS (32K tokens: the preset's 8 x 4096 is one), each wave all four phases;
a later wave's layer sums are added to the host's as they leave the device.

Each micro-batch's arithmetic is the plain path's with full activation checkpointing (every layer's forward runs
twice), so no other checkpointing applies. Each parameter's sum adds the same gradients in the same order as the
plain path, except a tied embedding's (the output layer's gradients of every micro-batch, then the embedding's).
The vocabulary-sized matrices (embedding and output layer) are summed on the device too where their fp32 sums
fit beside their stage (2 GiB each at 8B, not both at once), and otherwise, or when tied, keep the per-micro-batch
streaming of kiln.parallel.offload. The global norm takes the norms of the sums made on the device as they leave.

A mixture of experts (its router losses need every layer's statistics in one loss) keeps the per-micro-batch
schedule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

OptimizerOffload = Any  # kiln.parallel.offload's, which imports this module: passed in, never imported here

# tokens of the micro-batches run through a layer together (a wave): what the device holds of them (their hidden
# states, those states' gradients, the next layer's inputs: 3 x 2 bytes x d_model a token, 0.75 GiB at 8B) and the
# host of their layers' inputs (8.6 GB at 8B) stay bounded however many micro-batches a step has; the layers' sums
# of a later wave are added to the host's (8 bytes a parameter over PCIe a wave, not a micro-batch)
WAVE_TOKENS = 1 << 15


def supports(model: nn.Module) -> bool:
    """Whether `model` trains layer by layer: the native model without a mixture of experts."""
    from kiln.model.llama import Transformer

    return isinstance(model, Transformer) and model.cfg.moe is None


def wave_rows(rows: int, micro: int, seq_len: int) -> int:
    """Rows of a step's first (largest) wave: its micro-batches of `micro` rows run through a layer together."""
    return min(rows, max(1, WAVE_TOKENS // (micro * seq_len)) * micro)


def kept_bytes(n_layers: int, rows: int, seq_len: int, d_model: int, dtype_bytes: int) -> int:
    """Host memory of each layer's input of a wave's `rows` rows, kept from the forward pass for the backward."""
    return n_layers * rows * seq_len * d_model * dtype_bytes


class Kept:
    """Each layer's input of every micro-batch, from the forward pass to the backward: in one page-locked host buffer
    on a GPU (copied down and up on a side stream, a layer ahead of its use), as they are on the CPU."""

    def __init__(self, offload: OptimizerOffload):
        self.o = offload
        self.host: torch.Tensor | None = None  # (layers, rows, T, d)
        self.cpu: dict[tuple[int, int], torch.Tensor] = {}
        self.up: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Event]] = {}
        self.down: torch.cuda.Event | None = None  # the forward pass's last copy down

    def start(self, layers: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        self.cpu.clear()  # what an attempt cut short (an out-of-memory error) left
        self.up.clear()
        if not self.o.streams:
            return
        want = (layers, *shape)
        if self.host is None or tuple(self.host.shape) != want or self.host.dtype != dtype:
            self.close()
            self.host = torch.empty(want, dtype=dtype)
            self.o.lock(self.host)

    def put(self, layer: int, rows: slice, h: torch.Tensor) -> None:
        if not self.o.streams:
            self.cpu[layer, rows.start] = h
            return
        stream = self.o.streams[0]
        stream.wait_stream(torch.cuda.current_stream(h.device))
        with torch.cuda.stream(stream):
            self.host[layer, rows].copy_(h, non_blocking=True)
        h.record_stream(stream)

    def sealed(self) -> None:
        """After the forward pass: the copies up wait for its copies down."""
        if self.o.streams:
            self.down = self.o.streams[0].record_event()

    def fetch(self, layer: int, parts: list[slice], device: torch.device) -> None:
        """Start copying `layer`'s inputs up (before they are needed)."""
        if not self.o.streams or layer < 0:
            return
        stream = self.o.streams[1]
        stream.wait_event(self.down)
        with torch.cuda.stream(stream):
            for rows in parts:
                t = self.host[layer, rows].to(device, non_blocking=True)
                self.up[layer, rows.start] = (t, stream.record_event())

    def get(self, layer: int, rows: slice) -> torch.Tensor:
        if not self.o.streams:
            return self.cpu.pop((layer, rows.start))
        t, done = self.up.pop((layer, rows.start))
        torch.cuda.current_stream(t.device).wait_event(done)
        t.record_stream(torch.cuda.current_stream(t.device))
        return t

    def close(self) -> None:
        if self.host is not None and any(t is self.host for t in self.o._locked):
            torch.cuda.cudart().cudaHostUnregister(self.host.untyped_storage().data_ptr())
            self.o._locked = [t for t in self.o._locked if t is not self.host]
        self.host = None


def accumulate(o: OptimizerOffload, model: nn.Module, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None,
               micro: int, autocast) -> torch.Tensor:
    """Forward and backward of a step's rows x, y, docs (N, T) in micro-batches of `micro` rows, layer by layer (see
    the module doc), in waves of WAVE_TOKENS; each micro-batch's loss weighted by its share of the rows, as the plain
    path's. The gradients end in `o`'s sums. Returns the step's loss (on the device)."""
    n, T = x.shape
    parts = [slice(lo, min(lo + micro, n)) for lo in range(0, n, micro)]
    per = max(1, WAVE_TOKENS // (micro * T))
    waves = [parts[w:w + per] for w in range(0, len(parts), per)]
    total = torch.zeros((), device=x.device)
    for wave in waves:
        total += _wave(o, model, x, y, docs, wave, n, autocast, len(waves) == 1, waves[0][-1].stop)
    return total


def _wave(o: OptimizerOffload, model: nn.Module, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None,
          parts: list[slice], n: int, autocast, alone: bool, most: int) -> torch.Tensor:
    """The micro-batches `parts` of the step's n rows through every layer, forward then backward. `alone`: the
    step's only wave (its layers' sums go to the host as they are; else they are added there); `most`: the rows of
    the step's largest wave (the kept inputs' buffer)."""
    T = x.shape[1]
    share = [n / (p.stop - p.start) for p in parts]
    local = [slice(p.start - parts[0].start, p.stop - parts[0].start) for p in parts]  # rows in the wave
    layers = list(model.layers)
    kept = o.kept
    with torch.no_grad(), autocast():
        o.ready([model.embed_tokens.weight])  # the last step's AdamW may still run: each layer waits for its weights
        hs = [model.embed(x[p]) for p in parts]  # (b, T, d) each
        args = [model.block_args(None if docs is None else docs[p], T, hs[0].device) for p in parts]
        kept.start(len(layers), (most, T, hs[0].shape[-1]), hs[0].dtype)
        for i, block in enumerate(layers):
            o.ready(_trained(block))
            for k, p in enumerate(local):
                kept.put(i, p, hs[k])
                hs[k] = block(hs[k], *args[k][block.attention_kind])
    kept.sealed()
    kept.fetch(len(layers) - 1, local, hs[0].device)

    o.settle()  # the output layer's weights, and the sums the step is reading
    total = torch.zeros((), device=x.device)
    grads: list[torch.Tensor] = []
    head = _trained(model.norm) + [model.lm_head.weight]
    for k, p in enumerate(parts):  # the loss and the output layer
        h = hs[k].requires_grad_()
        with torch.enable_grad(), autocast():
            loss = model.head_loss(model.norm(h), y[p]) / share[k]
            out = torch.autograd.grad(loss, [h, *head], allow_unused=True)
        grads.append(out[0])
        _add(o, head, out[1:])
        del out  # the output layer's gradient (V x d): before the next micro-batch's loss makes its own
        total += loss.detach()
    del hs
    _finish(o, head, alone)

    for i in reversed(range(len(layers))):  # the blocks, the last first
        block, params = layers[i], _trained(layers[i])
        kept.fetch(i - 1, local, x.device)
        for k, p in enumerate(local):
            h = kept.get(i, p).requires_grad_()
            with torch.enable_grad(), autocast():
                out = block(h, *args[k][block.attention_kind])
                g = torch.autograd.grad(out, [h, *params], grads[k], allow_unused=True)
            grads[k] = g[0]
            _add(o, params, g[1:])
        _finish(o, params, alone)

    emb = [model.embed_tokens.weight]
    for k, p in enumerate(parts):  # the embedding
        with torch.enable_grad(), autocast():
            e = model.embed(x[p])
            g = torch.autograd.grad(e, emb, grads[k])
        grads[k] = None
        _add(o, emb, g)
    _finish(o, emb, alone)
    return total


def _trained(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _add(o: OptimizerOffload, params: list[nn.Parameter], grads) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            o.add_gradient(p, g)


def _finish(o: OptimizerOffload, params: list[nn.Parameter], alone: bool) -> None:
    for p in params:
        o.finish_gradient(p, alone)
