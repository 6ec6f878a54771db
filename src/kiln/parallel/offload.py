"""One-GPU training of a model whose optimizer does not fit beside it: the optimizer's state in host memory.

    model = place_model(model, device, torch.bfloat16)      # in parallelize (train.offload: optimizer)
    offload = OptimizerOffload(model, groups, ocfg, lr)     # in the Trainer; offload.optimizer is its AdamW
    loss = offload.accumulate(x, y, docs, micro, autocast)  # the native model: layer by layer
    grad_norm = offload.step(max_norm)                      # instead of clip + optimizer.step()

Where the bytes are (N parameters, bf16 compute):

    device   the weights in the compute dtype (2 N), a layer's fp32 gradient sums, two fp32 transfer slices
             (SLICE elements each), a layer's activations
    host     fp32 master weights (4 N) and the step's gradients summed in fp32 (4 N), both page-locked, AdamW's
             two moments (8 N): 16 N in all; and the layer-by-layer step's layer inputs (kiln.parallel.offload_layers)

The native model's step runs every micro-batch through a layer before the next (kiln.parallel.offload_layers):
a layer's gradients are summed in fp32 on the GPU (`add_gradient`) and, once its last micro-batch has passed,
their norms are taken there and the sums copied down once (`finish_gradient`). The vocabulary-sized matrices,
and every parameter of a model the layered step does not take (a mixture of experts), are summed as each
micro-batch's gradient completes (`_stream`: a post-accumulate-grad hook, or the layered step's call): on two
side CUDA streams, a slice at a time, the first micro-batch converts it to fp32 and copies it to its sum on the
host; a later one copies the sum up, adds the gradient on the GPU and copies it back. The host does no
arithmetic during the backward pass.

The step: the global norm (torch's: the norm of the parameters' norms), then AdamW on the master weights with
torch's fused CPU kernel, a slice of STEP_SLICE elements at a time with its gradient's clipping multiply just
before (the slice in the caches: no pass of its own; the same numbers as clipping, then AdamW), in chunks in the
order the forward pass uses them; each stepped chunk's fp32 masters are copied up and rounded to the compute
dtype on the GPU, on the side streams. Clipping needs the global norm, so no parameter steps before the last
gradient is summed: the update is exactly the plain path's, whatever the accumulation. Under the layered step
AdamW runs in a thread beside the next step's forward pass, each layer's forward waiting for its own weights
(`ready`); the rest of the step, and anything else that runs the model or reads the state (evaluation, a
checkpoint), waits for the whole step (`settle`).

On the CPU (tests) the "device" weights are a second copy in host memory and the sums are made there; the
schedules, the thread and the sliced step are the same code.

Checkpoints: `parts()` gives the model part (the fp32 master weights under the model's own names) and the
optimizer part (the moments in the layout of torch.distributed.checkpoint's optimizer state dict, keyed by
parameter names), so a checkpoint of an offloaded run resumes a plain one and the reverse.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from kiln.errors import ResourceError, TrainingError
from kiln.parallel import offload_layers

CHUNK = 1 << 26  # elements of master weights stepped together before their copy to the device starts
STEP_SLICE = 1 << 21  # elements of a master weight AdamW steps at a time: 8 MB a tensor, within the caches
SLICE = 1 << 24  # elements of a sum or a master weight moved at a time: two fp32 slices (64 MB each) on the GPU
LOSS_ROOM = 2 << 30  # device bytes kept free beside a vocabulary matrix's sum made there: the loss's chunk of logits
MASTERS = "_kiln_offload_masters"  # the model's attribute holding its fp32 master weights (place_model)


def host_bytes(n_params: int) -> int:
    """Host memory the offloaded state of `n_params` parameters takes: fp32 masters, two fp32 AdamW moments and
    the fp32 gradient sums."""
    return (4 + 8 + 4) * n_params


def host_available() -> int:
    """Bytes of host memory available now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(n_params: int, compute_bytes: int, on_cpu: bool = False, async_save: bool = False,
                      available: int | None = None, kept: int = 0) -> int:
    """Before the model is built: a ResourceError unless the offloaded state of `n_params` parameters (and on the
    CPU, where the "device" copy is in host memory too, that copy; with `async_save`, the copy of the fp32 weights
    and moments an asynchronous checkpoint writes from; `kept` bytes of the layers' inputs a step keeps,
    kiln.parallel.offload_layers) fits the host's available memory. Returns the bytes it needs."""
    staging = 12 * n_params if async_save else 0
    need = host_bytes(n_params) + (compute_bytes * n_params if on_cpu else 0) + staging + kept
    have = host_available() if available is None else available
    if need > have:
        more = (f" and the async checkpoint's staging copy (checkpoint.async_save: {staging / 1e9:.1f} GB; false "
                "writes checkpoints from host memory as they are)") if staging else ""
        cpu = (f", and the weights the CPU trains on {compute_bytes} (a second copy in host memory: on the CPU the "
               "offload saves nothing, and train.offload=none trains without it)") if on_cpu else ""
        inputs = f", the layers' inputs of a step {kept / 1e9:.1f} GB" if kept else ""
        raise ResourceError(
            f"train.offload=optimizer keeps the training state of {n_params / 1e9:.2f}B parameters in host memory: "
            f"{need / 1e9:.1f} GB (fp32 master weights 4, AdamW moments 8 and gradient sums 4 bytes a "
            f"parameter{cpu}{inputs}{more}), and this machine has {have / 1e9:.1f} GB available. "
            "Free host memory, use a machine with more (`kiln plan` states the need), or train with LoRA (lora.rank) "
            "or with several GPUs under FSDP instead")
    return need


def describe_need(need: int, on_cpu: bool) -> str:
    """The start-up line of an offloaded run: the host memory `check_host_memory` found room for; on the CPU, that
    the offload saves nothing there."""
    cpu = ("; on the CPU the weights it trains on are a second copy in the same memory and the offload saves "
           "nothing (it is for one GPU): train.offload=none trains with less") if on_cpu else ""
    return (f"train.offload=optimizer: {need / 1e9:.1f} GB of host memory for fp32 master weights, AdamW moments, "
            f"gradient sums and the layers' inputs of a step{cpu}")


def rollback_room(n_params: int, copies: int, available: int, share: float = 0.75) -> tuple[bool, int]:
    """(fits, bytes) of `copies` host copies of an offloaded run's state for rollbacks (kiln.train.rollback): fp32
    weights and two moments, 12 bytes a parameter each. `available` was read once the fp32 masters existed: the
    offload's moments and gradient sums are still to come out of `share` of it."""
    need = 12 * n_params * copies
    return need + host_bytes(n_params) - 4 * n_params <= share * available, need


@torch.no_grad()
def place_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Keep `model`'s fp32 weights (built on the CPU) as its master weights in host memory, all in one buffer (page-
    locked once by the offload), and give the model copies in `dtype` on `device` (buffers keep their dtype).
    Returns the model."""
    named = list(model.named_parameters())  # a tied weight once
    flat = torch.empty(sum(p.numel() for _, p in named), dtype=torch.float32)
    masters: dict[str, torch.Tensor] = {}
    at = 0
    for name, p in named:
        masters[name] = flat[at:at + p.numel()].view(p.shape).copy_(p.detach())
        at += p.numel()
        p.data = p.data.to(device, dtype, copy=True)  # a copy even on the CPU: the masters stay apart
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)
    setattr(model, MASTERS, masters)
    return model


def _lock(t: torch.Tensor) -> bool:
    """Page-lock the whole storage of host tensor `t` where it lies (cudaHostRegister; the caching host allocator
    would round a pinned allocation up to a power of two, a 32 GB buffer to 64 GB). Whether it was locked: a
    kernel limit on locked memory, say, leaves it pageable, and its copies synchronous."""
    storage = t.untyped_storage()
    if not storage.nbytes():
        return False
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)) != 0:
        cudart.cudaGetLastError()  # not left for the next CUDA call to report as its own
        return False
    return True


class OptimizerOffload:
    """AdamW on the host for a model on the device (see the module doc). `groups` are the device parameters in
    torch param-group form (weight decay per group); `optimizer` is a torch AdamW over their fp32 masters, which
    the learning-rate schedule drives as usual."""

    def __init__(self, model: nn.Module, groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 fused: bool | None = None):
        masters = getattr(model, MASTERS, None)
        if masters is None:
            raise RuntimeError("the model was not placed for offload (kiln.parallel.offload.place_model)")
        self.model = model
        named = dict(model.named_parameters())
        order = {id(p): i for i, p in enumerate(named.values())}  # the order the model holds (and uses) them
        self.params = sorted((p for g in groups for p in g["params"]), key=lambda p: order[id(p)])
        name_of = {id(p): n for n, p in named.items()}
        self.names = [name_of[id(p)] for p in self.params]
        self.masters = [masters[n].requires_grad_(True) for n in self.names]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.device = self.params[0].device
        # the fp32 sum of each parameter's gradients over the step's micro-batches, views of one buffer
        flat = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32)
        self.sums, self.offsets, at = [], [], 0
        for p in self.params:
            self.sums.append(flat[at:at + p.numel()].view(p.shape))
            self.offsets.append(at)
            at += p.numel()
        self.summed = [False] * len(self.params)  # whether the step has a gradient of each parameter yet
        # the layer-by-layer schedule: sums being made on the device, the norms of those that left, the inputs kept
        # from the forward pass, and the parameters whose sums are made on the host at once (the vocabulary-sized)
        self.layered = offload_layers.supports(model)
        self.device_sums: dict[int, torch.Tensor] = {}
        self.norms: dict[int, torch.Tensor] = {}
        self.kept = offload_layers.Kept(self)
        vocab = {id(model.embed_tokens.weight), id(model.lm_head.weight)} if self.layered else set()
        self.streamed = {i for i, p in enumerate(self.params) if id(p) in vocab}
        # an untied vocabulary matrix's sum is made on the device too when there is room for it beside its stage
        # (the loss, or the embedding's backward pass; `_vocab_fits`): 8 bytes a parameter less over PCIe a
        # micro-batch. A tied one's gradients arrive at both ends of the step, so it is always summed on the host.
        # None: decide by the device's free memory each step; True/False: always/never. One whose sum was on the
        # device when the step ran out of memory is summed on the host from then on (`vocab_host`), and `relieved`
        # tells the out-of-memory retry (kiln.train.oom) to run the step again at the same micro-batch
        self.vocab_here: bool | None = None
        self.vocab_host: set[int] = set()
        self.relieved = False
        self._untied = len(vocab) == 2
        self._locked: list[torch.Tensor] = []
        self.streams: list[torch.cuda.Stream] = []
        if self.device.type == "cuda":
            self.streams = [torch.cuda.Stream(self.device) for _ in range(2)]
            self._slices = [torch.empty(SLICE, dtype=torch.float32, device=self.device) for _ in self.streams]
            for t in (flat, self.masters[0]):
                self.lock(t)
        # gradients handed to the streams and not yet summed: (their streams' events, elements); the backward pass
        # waits while more than the largest parameter's are, so the device holds few gradients whatever PCIe's pace
        self._pending: deque = deque()
        self._pending_n, self._pending_max = 0, max(p.numel() for p in self.params)
        master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        host_groups = [{**{k: v for k, v in g.items() if k != "params"},
                        "params": [master_of[id(p)] for p in g["params"]]} for g in groups]
        self.optimizer = HostAdamW(host_groups, self, lr=lr, betas=betas, eps=eps,
                                   fused=True if fused is None else fused)
        self.chunks = _chunks(self.masters)
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self.params]
        # the layer-by-layer schedule steps AdamW in a thread while the next step's forward pass runs, each layer
        # once its weights are back (`ready`); anything else that runs the model waits for the whole step first
        self._thread: threading.Thread | None = None
        self._progress = threading.Condition()
        self._marks: list[tuple[int, list]] = []  # (parameters stepped and sent so far, the side streams' events)
        self._error: BaseException | None = None
        # its OpenMP team three quarters of the process's, so the training thread keeps cores to launch the forward
        # pass's kernels from (the team's threads spin between AdamW's slices): on a 32-core host a team of 31 took
        # 1.10 s to step 1e9 parameters, of 24 or 16 0.84 s (benchmarks/host_adamw.py)
        self._threads = max(1, torch.get_num_threads() * 3 // 4)
        self._hooks.append(model.register_forward_pre_hook(lambda *_: self.settle()))
        # where a step's host time goes, summed over `steps` steps: waiting after the backward pass for the last
        # gradients to be summed, and the step itself (norm, clipping, AdamW, copies back issued), of which the norm
        # and clipping
        self.seconds, self.steps = {"sums": 0.0, "step": 0.0, "norm": 0.0}, 0

    def lock(self, t: torch.Tensor) -> None:
        """Page-lock host tensor `t`'s storage (unlocked by `close`), where the system lets it."""
        if _lock(t):
            self._locked.append(t)

    def _slices_of(self, i: int):
        """(stream, its fp32 slice on the device, lo, hi) for each slice of parameter i: a slice takes its turn by
        its place in the sums, so the same slice always takes the same stream."""
        n = self.params[i].numel()
        for lo in range(0, n, SLICE):
            k = (self.offsets[i] + lo) // SLICE % 2
            yield self.streams[k], self._slices[k], lo, min(n, lo + SLICE)

    # the backward pass: each gradient into its fp32 sum on the host as soon as it is complete
    def _gradient_ready(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        self._stream(self.index[id(p)], grad)

    def _stream(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's gradient of one micro-batch into its fp32 sum on the host (on the device, a slice at a time,
        the sum copied up, added to and copied back)."""
        first, self.summed[i] = not self.summed[i], True
        total = self.sums[i].view(-1)
        if not self.streams:
            if first:
                total.copy_(grad.view(-1))
            else:
                total.add_(grad.view(-1))
            return
        g = grad.view(-1)
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for stream, work, lo, hi in self._slices_of(i):
            with torch.cuda.stream(stream):
                w = work[:hi - lo]
                if first:
                    w.copy_(g[lo:hi])
                else:
                    w.copy_(total[lo:hi], non_blocking=True)
                    w.add_(g[lo:hi])
                total[lo:hi].copy_(w, non_blocking=True)
        events = []
        for stream in self.streams:
            grad.record_stream(stream)  # its memory is reused only once the streams are done with it
            events.append(stream.record_event())
        self._pending.append((events, g.numel()))
        self._pending_n += g.numel()
        while self._pending_n > self._pending_max:
            done, n = self._pending.popleft()
            for e in done:
                e.synchronize()
            self._pending_n -= n

    # the layer-by-layer schedule (kiln.parallel.offload_layers): a layer's sums on the device until its last
    # micro-batch has passed
    def accumulate(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None, micro: int,
                   autocast) -> torch.Tensor:
        """A step's forward and backward passes, layer by layer (kiln.parallel.offload_layers). Returns its loss."""
        return offload_layers.accumulate(self, self.model, x, y, docs, micro, autocast)

    def add_gradient(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """One micro-batch's gradient of `p`: into its fp32 sum on the device (the vocabulary-sized matrices: on the
        host at once)."""
        i = self.index[id(p)]
        if i in self.streamed and not (i in self.device_sums or self._vocab_fits(i, grad)):
            self._stream(i, grad)
        elif i in self.device_sums:
            self.device_sums[i].add_(grad)
        else:
            self.device_sums[i] = grad.to(torch.float32, copy=True)

    def _vocab_fits(self, i: int, grad: torch.Tensor) -> bool:
        """Whether vocabulary matrix i's sum is made on the device this step: decided at its first micro-batch's
        gradient, when its stage's work has run once (its gradient, in the loss's fp32 buffer, still held). The sum
        (4 bytes a parameter) must fit in what the device (or its process's cap) has left, with LOSS_ROOM to spare
        for a later micro-batch's chunk of logits."""
        if self.summed[i] or not self._untied or i in self.vocab_host:
            return False
        if self.vocab_here is not None:
            return self.vocab_here
        return _room(self.device) >= 4 * grad.numel() + LOSS_ROOM

    def finish_gradient(self, p: torch.Tensor, alone: bool = True) -> None:
        """`p` has its gradients of a wave of micro-batches: its sum down to the host, and if the wave is the step's
        only one, its norm (on the device); else the wave's sum is added to the host's (`_stream`)."""
        i = self.index[id(p)]
        total = self.device_sums.pop(i, None)
        if total is None:  # streamed, or unused
            return
        if not alone:
            return self._stream(i, total)
        self.summed[i] = True
        self.norms[i] = torch.linalg.vector_norm(total)
        if not self.streams:
            self.sums[i].copy_(total)
            return
        stream = self.streams[0]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.sums[i].copy_(total, non_blocking=True)
        total.record_stream(stream)

    def wait(self) -> None:
        """Until the last step is done (`settle`) and every gradient of the backward passes since is in its sum on
        the host."""
        self.settle()
        for stream in self.streams:
            stream.synchronize()
        if self.streams:
            self._pending.clear()
            self._pending_n = 0

    def discard(self) -> None:
        """Forget the gradients summed so far (a step run again after an out-of-memory error)."""
        if not any(self.summed) and not self.device_sums:  # none: the step may go on in its thread
            return
        self.wait()
        moved = self.streamed & set(self.device_sums)
        if moved and self.vocab_here is None:  # no room after all (an out-of-memory retry): on the host from now on
            self.vocab_host |= moved
            self.relieved = True
        self.summed = [False] * len(self.params)
        self.device_sums.clear()
        self.norms.clear()

    # the step: norm, clipping, AdamW on the host, the new weights back to the device
    @torch.no_grad()
    def step(self, max_norm: float) -> torch.Tensor:
        """Clip the step's summed gradients to `max_norm` (inf: only measure) and step. Returns the norm."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        have = [i for i, s in enumerate(self.summed) if s]  # a parameter the step did not use has no gradient
        fused = self.optimizer.defaults.get("fused")
        # the global norm as torch's clipping computes it: the norm of the parameters' norms (those of sums made on
        # the device taken there, read in one copy)
        made = [i for i in have if i in self.norms]
        read = dict(zip(made, torch.stack([self.norms[i] for i in made]).cpu())) if made else {}
        norms = [read[i] if i in read else torch.linalg.vector_norm(self.sums[i]) for i in have]
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        self.norms.clear()
        # torch's clipping multiplies by min(1, max_norm / (norm + 1e-6)): by exactly 1 when the norm is within the
        # bound, which leaves the gradients as they are, so that pass over them is skipped; else the fused AdamW
        # multiplies each slice of a gradient just before it steps it (in the caches: no pass of its own)
        scale = None
        if not float(max_norm / (norm + 1e-6)) >= 1.0:  # NaN too, as torch would
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if not fused:  # torch's own clipping and AdamW.step, which read the masters' .grad
            for i in have:
                self.masters[i].grad = self.sums[i]
            if scale is not None:
                nn.utils.clip_grads_with_norm_([self.masters[i] for i in have], max_norm, norm)
                scale = None
        t2 = time.perf_counter()
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the backward pass is done with the weights
        stepped = [[i for i in chunk if self.summed[i]] for chunk in self.chunks]
        self.summed = [False] * len(self.params)
        lrs = {id(g): g["lr"] for g in self.optimizer.param_groups}  # the schedule moves on as the thread runs
        self.optimizer._opt_called = True  # what torch's schedulers check the optimizer stepped by (step() sets it)
        self.seconds["sums"] += t1 - t0
        self.seconds["norm"] += t2 - t1
        self.steps += 1
        self._marks, self._error = [], None
        if self.layered and fused:  # beside the next forward pass
            self._thread = threading.Thread(target=self._steps, args=(stepped, scale, lrs, t1), daemon=True,
                                            name="kiln-offload-adamw")
            self._thread.start()
        else:
            self._steps(stepped, scale, lrs, t1)
            self._done()
        return norm

    def _steps(self, stepped: list[list[int]], scale: torch.Tensor | None, lrs: dict, t1: float) -> None:
        """AdamW over the chunks of master weights in the forward pass's order, each chunk sent to the device as soon
        as it is stepped (marked for `ready`)."""
        try:
            if self.streams and threading.current_thread() is self._thread:
                torch.set_num_threads(self._threads)  # torch's count for the process (its CPU work here is small)
            with torch.cuda.device(self.device) if self.streams else contextlib.nullcontext():
                for chunk, indices in zip(self.chunks, stepped):
                    if indices:
                        self.optimizer.step_only(indices, scale, lrs)
                        for i in indices:
                            self.masters[i].grad = None
                        self._send(indices)
                    with self._progress:
                        self._marks.append((chunk[-1] + 1, [st.record_event() for st in self.streams]))
                        self._progress.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised again by settle, in the training thread
            with self._progress:
                self._error = e
                self._progress.notify_all()
        self.seconds["step"] += time.perf_counter() - t1

    def ready(self, params: list[torch.Tensor]) -> None:
        """Before the forward pass uses `params`: until the step in flight has stepped and sent them (the device's
        stream waits for their copies)."""
        mine = [self.index[id(p)] for p in params if id(p) in self.index]
        if self._thread is None or not mine:
            return
        last = max(mine)
        with self._progress:
            self._progress.wait_for(lambda: self._error is not None or (self._marks and self._marks[-1][0] > last))
            mark = next((events for upto, events in self._marks if upto > last), None)
        if mark is None:
            return self.settle()  # the thread failed: its error
        for event in mark:
            torch.cuda.current_stream(self.device).wait_event(event)

    def settle(self) -> None:
        """Until the step in flight is done: its AdamW and every weight's copy to the device; its error, if any."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        self._done()

    def _done(self) -> None:
        """After AdamW: the next forward pass waits for the weights' copies; AdamW's error, if any, raised here."""
        for stream in self.streams:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._error is not None:
            error, self._error = self._error, None
            raise _step_failed(error) from error

    def _send(self, indices: list[int]) -> None:
        """The master weights `indices` to the device, rounded there to the compute dtype (on the side streams)."""
        for i in indices:
            weights, master = self.params[i].detach().view(-1), self.masters[i].detach().view(-1)
            if not self.streams:
                weights.copy_(master)
                continue
            for stream, work, lo, hi in self._slices_of(i):
                with torch.cuda.stream(stream):
                    w = work[:hi - lo]
                    w.copy_(master[lo:hi], non_blocking=True)
                    weights[lo:hi].copy_(w)

    @torch.no_grad()
    def send_all(self) -> None:
        """Every master weight to the device, and wait for it (after a load)."""
        self.wait()
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        self._send(list(range(len(self.params))))
        self.wait()

    def host_model(self, mcfg) -> nn.Module:
        """The model with the fp32 master weights, on the CPU and sharing their memory (what model/ is written from,
        as a plain run writes its fp32 weights); `mcfg` is the native model's config. Its rope tables are not
        built: it is for its state dict."""
        from kiln.model.llama import Transformer

        with torch.device("meta"):
            plain = Transformer(mcfg)
        plain.load_state_dict(MasterWeights(self).state_dict(), assign=True)
        return plain

    def parts(self) -> dict[str, Any]:
        """The checkpoint parts this offload replaces: "model" (fp32 masters) and "optim" (AdamW's moments)."""
        return {"model": MasterWeights(self), "optim": HostOptimizerState(self)}

    def close(self) -> None:
        """After training: remove the hooks and unlock the host buffers. The masters stay (model/ is written from
        them); a later `send_all` copies synchronously."""
        if not self._hooks:
            return
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.kept.close()
        for t in self._locked:
            torch.cuda.cudart().cudaHostUnregister(t.untyped_storage().data_ptr())
        self._locked = []
        self.streams = []


def _room(device: torch.device) -> int:
    """Bytes the caching allocator can still hand out on `device`: under the process's cap
    (torch.cuda.set_per_process_memory_fraction) and the device's free memory; none on the CPU (its sums are in
    host memory anyway)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer than the oldest torch declared
    cap = int(props.total_memory * (fraction(device) if fraction else 1.0))
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    return min(cap - allocated, free + torch.cuda.memory_reserved(device) - allocated)


def _step_failed(error: BaseException) -> Exception:
    """What AdamW's failure (in its thread or not) raises: not the error itself, which the next step's forward pass
    would meet, and an out-of-memory one there would be retried as the device's (kiln.train.oom) on weights half
    stepped; nor an error an emergency checkpoint follows (the state is half updated)."""
    oom = isinstance(error, (MemoryError, torch.OutOfMemoryError))
    what = "ran out of host memory" if oom else "failed"
    return (ResourceError if oom else TrainingError)(
        f"the offloaded optimizer step (train.offload=optimizer: AdamW on the host's fp32 master weights) {what}: "
        f"{type(error).__name__}: {error}. Its weights and moments are part-way through that step, so no emergency "
        "checkpoint is written; " + ("free host memory (`kiln plan` states what the offload needs) and " if oom
                                     else "") + "resume from the last complete checkpoint (`kiln train RUN_DIR`)")


def _chunks(masters: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive indices of `masters` in runs of about CHUNK elements (a larger parameter alone)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, m in enumerate(masters):
        if out[-1] and size + m.numel() > CHUNK:
            out.append([])
            size = 0
        out[-1].append(i)
        size += m.numel()
    return out


class HostAdamW(torch.optim.AdamW):
    """torch's AdamW over the master weights, which can step some of them only; `zero_grad` also forgets the
    gradients the offload has summed (an out-of-memory retry of a step starts its sums again)."""

    def __init__(self, groups: list[dict], offload: OptimizerOffload, **kw: Any):
        super().__init__(groups, **kw)
        self._offload = offload
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}  # the groups are fixed

    def step_only(self, indices: list[int], scale: torch.Tensor | None = None, lrs: dict | None = None) -> None:
        """Step the masters `indices`, their gradients (the offload's sums) multiplied by `scale` first (clipping);
        `lrs`: each param group's learning rate by its id, taken when the step began (default: the groups')."""
        if self.defaults.get("fused"):
            return self._fused_slices(indices, scale, lrs or {})
        if scale is not None:
            raise ValueError("clipping inside the step is the fused kernel's")
        masters = self._offload.masters
        chosen = {id(masters[i]) for i in indices}
        saved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in chosen:
                    saved.append((p, p.grad))
                    p.grad = None
        try:
            self.step()
        finally:
            for p, g in saved:
                p.grad = g

    def _fused_slices(self, indices: list[int], scale: torch.Tensor | None, lrs: dict) -> None:
        """torch's fused AdamW (the kernel AdamW(fused=True).step calls, with its arguments), a slice of STEP_SLICE
        elements at a time, each slice's gradient clipped just before: the same numbers (the kernel works element by
        element, and every slice but a parameter's last is a whole number of its vectors), with each slice's
        gradient, weights and moments read from memory once."""
        for i in indices:
            master = self._offload.masters[i]
            group, state = self._group_of[id(master)], self.state[master]
            if not state:
                state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(master),
                             exp_avg_sq=torch.zeros_like(master))
            state["step"] += 1
            p, g, m, v = (t.view(-1) for t in (master, self._offload.sums[i], state["exp_avg"], state["exp_avg_sq"]))
            beta1, beta2 = group["betas"]
            lr = lrs.get(id(group), group["lr"])
            for lo in range(0, p.numel(), STEP_SLICE):
                hi = min(p.numel(), lo + STEP_SLICE)
                if scale is not None:
                    g[lo:hi].mul_(scale)
                torch._fused_adamw_([p[lo:hi]], [g[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [state["step"]],
                                    amsgrad=group["amsgrad"], lr=lr, beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                                    grad_scale=None, found_inf=None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._offload.discard()  # after the host thread has summed what is queued (it may be behind)


class MasterWeights:
    """The "model" part of an offloaded run: the fp32 master weights under the model's own names (what a plain
    run saves); loading one copies them to the device."""

    def __init__(self, offload: OptimizerOffload):
        self.offload = offload

    def state_dict(self) -> dict[str, Any]:
        o = self.offload
        o.wait()
        out = dict(zip(o.names, o.masters))
        for name, p in o.model.named_parameters(remove_duplicate=False):  # a tied weight under both names
            if name not in out:
                out[name] = o.masters[o.index[id(p)]]
        for name, buf in o.model.state_dict().items():  # persistent buffers, if any
            if name not in out:
                out[name] = buf
        return {k: v.detach() for k, v in out.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        o = self.offload
        o.wait()  # a step in flight (a rollback restores while its AdamW runs) would write over what is loaded
        for name, m in zip(o.names, o.masters):
            if state[name] is not m:
                m.copy_(state[name])
        buffers = o.model.state_dict()
        for name, value in state.items():
            if name not in o.names and name in buffers and not any(value is m for m in o.masters):
                buffers[name].copy_(value)
        o.send_all()


class HostOptimizerState:
    """The "optim" part of an offloaded run: AdamW's state of each master weight, keyed by the parameter's name,
    with the param groups naming their parameters (torch.distributed.checkpoint's optimizer state dict layout).
    Reading it creates the state (zero moments, step 0) where it does not exist yet; loading keeps the config's
    hyperparameters."""

    def __init__(self, offload: OptimizerOffload):
        self.offload = offload

    def _ensure_state(self) -> None:
        opt = self.offload.optimizer
        for m in self.offload.masters:
            if not opt.state.get(m):
                fused = opt.defaults.get("fused")
                opt.state[m] = {"step": torch.zeros((), dtype=torch.float32 if fused else torch.get_default_dtype()),
                                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}

    def state_dict(self) -> dict[str, Any]:
        o, opt = self.offload, self.offload.optimizer
        o.wait()
        self._ensure_state()
        name_of = {id(m): n for n, m in zip(o.names, o.masters)}
        state = {name_of[id(m)]: dict(opt.state[m]) for m in o.masters}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
                  for g in opt.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        o, opt = self.offload, self.offload.optimizer
        o.wait()  # as MasterWeights': the moments of a step in flight are not loaded over
        self._ensure_state()
        for name, m in zip(o.names, o.masters):
            saved, mine = state["state"][name], opt.state[m]
            for key, value in saved.items():
                if key in mine and isinstance(value, torch.Tensor):
                    if value is not mine[key]:
                        mine[key].copy_(value)
                else:
                    mine[key] = value
