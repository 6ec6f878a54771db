"""The chunked cross-entropy's elementwise kernel, Triton's (kiln.model.loss_triton) against PyTorch's compiled by
torch.compile (kiln.model.loss.chunk_loss_and_grad, as `kiln train` with train.compile runs it), on one GPU.

    python benchmarks/cross_entropy.py --json benchmarks/results/cross_entropy_h100.json

Two measurements, each both ways in one process:
- one chunk (--chunks, rows x vocabulary of bf16 logits): the summed loss and the logits' gradient, ms per call
  and GB/s counting the traffic of two passes (the logits read twice, the gradient written once), for Triton's
  kernel at its default launch and at each --sweep launch (block:warps), with the gradient written over the logits
  as the chunked loss lets it; Triton's loss and gradient are checked against PyTorch's first (columns 'loss diff',
  relative, and 'grad diff', the largest absolute difference);
- the whole `linear_cross_entropy` forward and backward (--losses, rows x d_model x vocabulary: fp32 hidden states
  and output weight under bf16 autocast, as in training), ms and peak memory.
The ratio column is PyTorch's time over each row's. Without a GPU (or triton) the Triton rows are left out and said
so (under TRITON_INTERPRET=1 they run on the CPU, slowly, through Triton's interpreter); --torch eager times
PyTorch's uncompiled kernel instead (the CPU smoke run).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/cross_entropy.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import functools
import json
from collections.abc import Callable

import torch

from benchmarks.common import device as pick_device
from benchmarks.common import free, peak_gib, run_info, seconds_per_call, table, write_json
from kiln.model import loss as loss_module
from kiln.model import loss_triton
from kiln.model.loss import chunk_loss_and_grad, linear_cross_entropy


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.lower().split("x"))


def torch_kernel(how: str) -> Callable:
    return torch.compile(chunk_loss_and_grad, fullgraph=True) if how == "compiled" else chunk_loss_and_grad


def chunk_rows(rows: int, vocab: int, dtype: torch.dtype, dev: torch.device, how: str, sweep: list[str],
               iters: int, warmup: int, triton_ok: bool) -> list[dict]:
    """Rows of the table for one chunk of logits: PyTorch's kernel, then Triton's at each launch."""
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g, device=dev) * 2).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g, device=dev)
    targets[::17] = -100
    traffic = 3 * logits.numel() * logits.element_size()
    shape = f"{rows}x{vocab} {str(dtype).removeprefix('torch.')}"
    fn = torch_kernel(how)
    want_loss, want_grad = fn(logits, targets, True)
    base = seconds_per_call(lambda: fn(logits, targets, True), iters, warmup, dev)
    out = [{"what": "chunk", "shape": shape, "kernel": f"torch ({how})", "ms": 1e3 * base,
            "gbps": traffic / base / 1e9}]
    if not triton_ok:
        return out
    for launch in [""] + sweep:
        try:
            out.append(_triton_row(logits, targets, launch, want_loss, want_grad, base, traffic, iters, warmup, dev))
        except Exception as e:  # noqa: BLE001 (a launch Triton cannot build is a row that says so)
            out.append({"what": "chunk", "shape": shape, "kernel": f"triton {launch or 'default'}: failed: "
                        f"{type(e).__name__}: {e}"[:160]})
        logits.copy_((torch.randn(rows, vocab, generator=g, device=dev) * 2).to(dtype))
        want_loss, want_grad = fn(logits, targets, True)
    return out


def _triton_row(logits: torch.Tensor, targets: torch.Tensor, launch: str, want_loss: torch.Tensor,
                want_grad: torch.Tensor, base: float, traffic: int, iters: int, warmup: int, dev: torch.device) -> dict:
    """Triton's kernel at `launch` ('block:warps', '' for its default): checked against PyTorch's, then timed
    writing over the logits."""
    rows, vocab = logits.shape
    block, warps = (int(x) for x in launch.split(":")) if launch else (None, None)
    run = functools.partial(loss_triton.chunk_loss_and_grad, logits, targets, True, block=block, warps=warps,
                            in_place=True)
    loss, grad = loss_triton.chunk_loss_and_grad(logits, targets, True, block=block, warps=warps)
    loss_diff = ((loss - want_loss).abs() / want_loss.abs()).item()
    grad_diff = (grad.float() - want_grad.float()).abs().max().item()
    del grad
    t = seconds_per_call(run, iters, warmup, dev)  # over the logits: from here on they hold a gradient
    b, w = (block, warps) if launch else loss_triton.launch_shape(vocab, logits.dtype)
    return {"what": "chunk", "shape": f"{rows}x{vocab} {str(logits.dtype).removeprefix('torch.')}",
            "kernel": f"triton {b}:{w}" + ("" if launch else " (default)"), "ms": 1e3 * t,
            "gbps": traffic / t / 1e9, "vs_torch": base / t, "loss_diff": loss_diff, "grad_diff": grad_diff}


def loss_rows(rows: int, d: int, vocab: int, dev: torch.device, how: str, iters: int, warmup: int,
              triton_ok: bool) -> list[dict]:
    """Rows of the table for `linear_cross_entropy`'s forward and backward: PyTorch's kernel, then Triton's."""
    g = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(rows, d, generator=g, device=dev).requires_grad_()
    w = (torch.randn(vocab, d, generator=g, device=dev) * d**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g, device=dev)
    targets[::17] = -100
    autocast = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()

    def step():
        h.grad = w.grad = None
        with autocast:
            loss = linear_cross_entropy(h, w, targets)
        loss.backward()
        return loss

    out, base, losses = [], None, {}
    torch_fn = torch_kernel(how)
    kernels = [(f"torch ({how})", torch_fn)] + ([("triton", loss_triton.TritonChunkKernel(torch_fn))] if triton_ok
                                                else [])
    saved = loss_module.ChunkKernel.__dict__["fn"]
    try:
        for name, kernel in kernels:
            loss_module.ChunkKernel.fn = kernel
            free()
            losses[name] = step().item()
            t = seconds_per_call(step, iters, warmup, dev)
            base = base or t
            out.append({"what": "linear_cross_entropy fwd+bwd", "shape": f"{rows}x{d} V{vocab}", "kernel": name,
                        "ms": 1e3 * t, "vs_torch": base / t, "peak_gib": peak_gib() or None,
                        "loss_diff": abs(losses[name] - losses[kernels[0][0]]) / abs(losses[kernels[0][0]])})
            if name == "triton" and kernel.failed:
                out[-1]["kernel"] += f" (failed, PyTorch's ran: {kernel.failed[:80]})"
    finally:
        loss_module.ChunkKernel.fn = saved
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="8192x32000,8192x128256", help="rows x vocabulary of each chunk timed")
    p.add_argument("--losses", default="65536x768x32000,8192x4096x128256",
                   help="rows x d_model x vocabulary of each linear_cross_entropy timed")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="dtype of the chunks' logits")
    p.add_argument("--sweep", default="4096:8,8192:16,16384:16,32768:32",
                   help="more block:warps launches of Triton's kernel timed on the chunks ('' for none)")
    p.add_argument("--torch", default="compiled", choices=["compiled", "eager"], help="PyTorch's kernel: compiled "
                   "with torch.compile (as under train.compile) or eager")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--json", help="write every result here as JSON")
    a = p.parse_args(argv)
    dev = pick_device(a.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    missing = loss_triton.unavailable() if dev.type == "cuda" else f"the device is {dev}, not a CUDA GPU"
    if dev.type == "cpu" and loss_triton.interpreting():  # TRITON_INTERPRET=1: its rows run, slowly, on the CPU
        missing = None
    if missing:
        print(f"triton unavailable: {missing}; its rows are left out", flush=True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    sweep = [s for s in a.sweep.split(",") if s]
    results: list[dict] = []
    for spec in filter(None, a.chunks.split(",")):
        rows, vocab = _shape(spec)
        results += chunk_rows(rows, vocab, dtype, dev, a.torch, sweep, a.iters, a.warmup, not missing)
        print(json.dumps(results[-1]), flush=True)
        free()
    for spec in filter(None, a.losses.split(",")):
        rows, d, vocab = _shape(spec)
        results += loss_rows(rows, d, vocab, dev, a.torch, a.iters, a.warmup, not missing)
        print(json.dumps(results[-1]), flush=True)
        free()

    env = run_info(dev, packages=["triton"], triton_left_out=missing)
    write_json(a.json, {"env": env, "argv": argv or sys.argv[1:], "results": results})
    print(f"\n{env}")
    print(table(results, [
        ("measured", "what"), ("shape", "shape"), ("kernel", "kernel"), ("ms", "ms", ".3f"),
        ("GB/s", "gbps", ",.0f"), ("vs torch", "vs_torch", "{:.2f}x"), ("peak GiB", "peak_gib", ".2f"),
        ("loss diff", "loss_diff", ".1e"), ("grad diff", "grad_diff", ".1e")]))
    for r in results:  # the default launch's ratio, the headline
        if r["kernel"] == "triton" or r["kernel"].endswith("(default)"):
            print(f"{r['what']} {r['shape']}: triton / torch ({a.torch}) {r['vs_torch']:.2f}x faster")
    return results


if __name__ == "__main__":
    main()
