"""One-GPU training of a model whose optimizer does not fit beside it: the optimizer's state in host memory.

    model = place_model(model, device, torch.bfloat16)      # in parallelize (train.offload: optimizer)
    offload = OptimizerOffload(model, groups, ocfg, lr)     # in the Trainer; offload.optimizer is its AdamW
    ... forward, backward (each micro-batch) ...
    grad_norm = offload.step(max_norm)                      # instead of clip + optimizer.step()

Where the bytes are (N parameters, bf16 compute):

    device   the weights in the compute dtype (2 N), one parameter's gradient at a time, activations
    host     fp32 master weights (4 N), AdamW's two moments (8 N), the step's gradients summed in fp32
             (4 N), and one pinned buffer per parameter in the compute dtype (2 N): 18 N in all

The backward pass: as soon as a parameter's gradient is complete (a post-accumulate-grad hook), a side
CUDA stream copies it into that parameter's pinned buffer (non-blocking) and the gradient is freed on the
device; a host thread waits for each copy and adds it, in fp32, to the step's sum (the first micro-batch
of a step copies instead of adding). The copies and the sums run while the backward pass goes on. A
parameter's next copy waits until its buffer is summed, so the buffers are reused without a race.

The step, after the last micro-batch: the global gradient norm over the fp32 sums, clipping, then
torch's AdamW (the fused, vectorised and multi-threaded CPU kernel by default) on the master weights,
a chunk of parameters at a time in the order the forward pass uses them; each stepped chunk is rounded to
the compute dtype into the pinned buffers and copied to the device on the side stream while the next
chunk steps. Clipping needs the global norm, so no parameter steps before the last gradient of the step
is summed: the update is exactly that of the plain path (the same clipping and AdamW code on the same fp32
sums), whatever the accumulation. The next forward pass waits for the copies on the device.

On the CPU (tests) the "device" weights are a second copy in host memory and the copies are synchronous;
the hooks, the host thread, the sums and the chunked step are the same code.

Checkpoints: `parts()` gives the model part (the fp32 master weights under the model's own names) and the
optimizer part (the moments in the layout of torch.distributed.checkpoint's optimizer state dict, keyed by
parameter names), so a checkpoint of an offloaded run resumes a plain one and the reverse.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import torch
from torch import nn

from kiln.errors import ResourceError

CHUNK = 1 << 26  # elements of master weights stepped together before their copy to the device starts
SUM_SLICE = 1 << 26  # elements of a gradient converted to fp32 at a time (a 256 MB scratch) to be summed
MASTERS = "_kiln_offload_masters"  # the model's attribute holding its fp32 master weights (place_model)


def host_bytes(n_params: int, compute_bytes: int = 2) -> int:
    """Host memory the offloaded state of `n_params` parameters takes: fp32 masters, two fp32 AdamW moments,
    the fp32 gradient sums and one pinned buffer in the compute dtype."""
    return (4 + 8 + 4 + compute_bytes) * n_params


def host_available() -> int:
    """Bytes of host memory available now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(n_params: int, compute_bytes: int, on_cpu: bool = False, async_save: bool = False,
                      available: int | None = None) -> int:
    """Before the model is built: a ResourceError unless the offloaded state of `n_params` parameters (and on the
    CPU, where the "device" copy is in host memory too, that copy; with `async_save`, the copy of the fp32 weights
    and moments an asynchronous checkpoint writes from) fits the host's available memory. Returns the bytes it
    needs."""
    staging = 12 * n_params if async_save else 0
    need = host_bytes(n_params, compute_bytes) + (compute_bytes * n_params if on_cpu else 0) + staging
    have = host_available() if available is None else available
    if need > have:
        more = (f" and the async checkpoint's staging copy (checkpoint.async_save: {staging / 1e9:.1f} GB; false "
                "writes checkpoints from host memory as they are)") if staging else ""
        raise ResourceError(
            f"train.offload=optimizer keeps the training state of {n_params / 1e9:.2f}B parameters in host memory: "
            f"{need / 1e9:.1f} GB (fp32 master weights 4, AdamW moments 8, gradient sums 4 and pinned transfer "
            f"buffers {compute_bytes} bytes a parameter{more}), and this machine has {have / 1e9:.1f} GB available. "
            "Free host memory, use a machine with more (`kiln plan` states the need), or train with LoRA (lora.rank) "
            "or with several GPUs under FSDP instead")
    return need


def rollback_room(n_params: int, copies: int, available: int, compute_bytes: int = 2,
                  share: float = 0.75) -> tuple[bool, int]:
    """(fits, bytes) of `copies` host copies of an offloaded run's state for rollbacks (kiln.train.rollback): fp32
    weights and two moments, 12 bytes a parameter each. `available` was read once the fp32 masters existed: the
    offload's moments, gradient sums and pinned buffers are still to come out of `share` of it."""
    need = 12 * n_params * copies
    return need + host_bytes(n_params, compute_bytes) - 4 * n_params <= share * available, need


@torch.no_grad()
def place_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Keep `model`'s fp32 weights (built on the CPU) as its master weights in host memory and give the model
    copies in `dtype` on `device` (buffers keep their dtype). Returns the model."""
    masters: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # a tied weight once
        masters[name] = p.detach().to("cpu", torch.float32)
        p.data = p.data.to(device, dtype, copy=True)  # a copy even on the CPU: the masters stay apart
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)
    setattr(model, MASTERS, masters)
    return model


def _pinned_views(params: list[torch.Tensor], cuda: bool) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    """One host buffer for every parameter, in their dtype (one dtype: the compute dtype), and a view of it for
    each. On CUDA it is page-locked where it lies (cudaHostRegister): the caching host allocator would round a
    pinned allocation up to a power of two (a 16 GB buffer to 32 GB). The flag: whether it was registered (and is
    to be unregistered before it is freed)."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    registered = False
    if cuda and flat.numel():
        code = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel() * flat.element_size(), 0))
        registered = code == 0
        if not registered:  # registering failed (a kernel limit on locked memory, say): the allocator's pinned memory
            flat = flat.pin_memory()
    views, at = [], 0
    for p in params:
        views.append(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()
    return flat, views, registered


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
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # per parameter: the pinned buffer its gradient comes through (and its new weights go back through), and
        # the fp32 sum of its gradients over the step's micro-batches
        self._flat, self.buffers, self._registered = _pinned_views(self.params, cuda)
        self.sums = [torch.empty(p.shape, dtype=torch.float32) for p in self.params]
        self._scratch = torch.empty(min(SUM_SLICE, max(p.numel() for p in self.params)), dtype=torch.float32)
        self.summed = [False] * len(self.params)  # whether the step has a gradient of each parameter yet
        self.free = [threading.Event() for _ in self.params]  # its buffer may take the next gradient
        for e in self.free:
            e.set()
        master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        host_groups = [{**{k: v for k, v in g.items() if k != "params"},
                        "params": [master_of[id(p)] for p in g["params"]]} for g in groups]
        self.optimizer = HostAdamW(host_groups, self, lr=lr, betas=betas, eps=eps,
                                   fused=True if fused is None else fused)
        self.chunks = _chunks(self.masters)
        self._work: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._sum_gradients, name="kiln-offload-sum", daemon=True)
        self._thread.start()
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self.params]
        # where a step's host time goes, summed over `steps` steps: waiting after the backward pass for the last
        # gradients to be summed, and the step itself (norm, clipping, AdamW, copies back issued)
        self.seconds, self.steps = {"sums": 0.0, "step": 0.0}, 0

    # the backward pass: each gradient to the host as soon as it is complete
    def _gradient_ready(self, p: torch.Tensor) -> None:
        i = self.index[id(p)]
        grad, p.grad = p.grad, None
        self.free[i].wait()  # its buffer's previous gradient is summed
        self.free[i].clear()
        if self.stream is None:
            self.buffers[i].copy_(grad)
            self._work.put((i, None))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.buffers[i].copy_(grad, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        grad.record_stream(self.stream)  # its memory is reused only once the copy is done
        self._work.put((i, done))

    def _sum_gradients(self) -> None:
        """The host thread: each gradient copied, added to its parameter's fp32 sum."""
        while True:
            i, done = self._work.get()
            try:
                if i is None:
                    return
                if self._error is None:
                    if done is not None:
                        done.synchronize()
                    if self.summed[i]:
                        self._add(self.sums[i].view(-1), self.buffers[i].view(-1))
                    else:
                        self.sums[i].copy_(self.buffers[i])
                        self.summed[i] = True
            except BaseException as e:  # noqa: BLE001 - raised in the training thread at the step
                self._error = e
            finally:
                if i is not None:
                    self.free[i].set()
                self._work.task_done()

    def _add(self, total: torch.Tensor, part: torch.Tensor) -> None:
        """total (fp32) += part (the compute dtype), through an fp32 scratch a slice at a time: torch's add of a
        bf16 tensor into an fp32 one runs about 4x slower than a conversion and an fp32 add (measured on the CPU);
        the result is the same (a bf16 value converts to fp32 exactly)."""
        if part.dtype == total.dtype:
            total.add_(part)
            return
        for lo in range(0, part.numel(), SUM_SLICE):
            piece = part[lo:lo + SUM_SLICE]
            scratch = self._scratch[:piece.numel()]
            scratch.copy_(piece)
            total[lo:lo + SUM_SLICE].add_(scratch)

    def wait(self) -> None:
        """Until every gradient of the backward passes so far is summed (raises what the host thread raised)."""
        self._work.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def discard(self) -> None:
        """Forget the gradients summed so far (a step run again after an out-of-memory error)."""
        self.wait()
        self.summed = [False] * len(self.params)

    # the step: norm, clipping, AdamW on the host, the new weights back to the device
    @torch.no_grad()
    def step(self, max_norm: float) -> torch.Tensor:
        """Clip the step's summed gradients to `max_norm` (inf: only measure) and step. Returns the norm."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        have = [i for i, s in enumerate(self.summed) if s]  # a parameter the step did not use has no gradient
        for i in have:
            self.masters[i].grad = self.sums[i]
        grads = [self.sums[i] for i in have]
        norm = nn.utils.get_total_norm(grads, 2.0)
        # torch's clipping multiplies by min(1, max_norm / (norm + 1e-6)): by exactly 1 when the norm is within the
        # bound, which leaves the gradients as they are, so that pass over them (a read and a write) is skipped
        if not float(max_norm / (norm + 1e-6)) >= 1.0:  # NaN too, as torch would
            nn.utils.clip_grads_with_norm_([self.masters[i] for i in have], max_norm, norm)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the backward pass is done with them
        for chunk in self.chunks:
            stepped = [i for i in chunk if self.summed[i]]
            if not stepped:
                continue
            self.optimizer.step_only(stepped)
            for i in stepped:
                self.masters[i].grad = None
            self._send(stepped)
        self.summed = [False] * len(self.params)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # the next forward pass waits for them
        self.seconds["sums"] += t1 - t0
        self.seconds["step"] += time.perf_counter() - t1
        self.steps += 1
        return norm

    def _send(self, indices: list[int]) -> None:
        """The master weights `indices`, rounded to the compute dtype, to the device (on the side stream)."""
        for i in indices:
            self.buffers[i].copy_(self.masters[i])
            if self.stream is None:
                self.params[i].detach().copy_(self.buffers[i])
                continue
            with torch.cuda.stream(self.stream):
                self.params[i].detach().copy_(self.buffers[i], non_blocking=True)

    @torch.no_grad()
    def send_all(self) -> None:
        """Every master weight to the device, and wait for it (after a load)."""
        self.wait()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._send(list(range(len(self.params))))
        if self.stream is not None:
            self.stream.synchronize()

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
        """After training: stop the host thread (which holds this object), remove the hooks and unlock the transfer
        buffers. The masters stay (model/ is written from them); a later `send_all` copies synchronously."""
        if not self._thread.is_alive():
            return
        self._work.join()  # (an error of the host thread is not raised here: the run is over)
        for h in self._hooks:
            h.remove()
        self._work.put((None, None))
        self._thread.join()
        if self._registered:
            if self.stream is not None:
                self.stream.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._flat.data_ptr())
            self._registered = False


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

    def step_only(self, indices: list[int]) -> None:
        """Step the masters `indices` (those with a .grad; AdamW passes over parameters without one)."""
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
        self._ensure_state()
        for name, m in zip(o.names, o.masters):
            saved, mine = state["state"][name], opt.state[m]
            for key, value in saved.items():
                if key in mine and isinstance(value, torch.Tensor):
                    if value is not mine[key]:
                        mine[key].copy_(value)
                else:
                    mine[key] = value
