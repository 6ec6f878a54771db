"""The offload's host step alone: Kiln's (kiln.parallel.offload: fused AdamW a slice at a time, clipping inside, the
weights sent back to the device as they are stepped) against torch's AdamW(fused=True).step() over the same fp32
masters and gradients (the step Kiln's offload took before, with clipping as a pass of its own), in one process.

    python benchmarks/host_adamw.py --params 2e9          # on a GPU machine: the weights go back to the GPU
    python benchmarks/host_adamw.py --params 1e6 --device cpu

The host step is bound by host memory: each parameter's fp32 weight, gradient and two moments are read and three
of them written (28 bytes), and the weight read again for its copy to the device (4). The table gives seconds a
step and GB/s at 28 bytes a parameter, for: torch's whole-tensor fused step with clipping before it (clip_grad's
multiply over every gradient); Kiln's step in the calling thread; Kiln's step in its own thread, as the
layer-by-layer schedule runs it beside the next forward pass (waited for at once here). Every variant steps the
same state from the same starting values; the weights they end with are compared (bit for bit).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/host_adamw.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import time

import torch
from torch import nn

from benchmarks.common import run_info, table, write_json
from kiln.parallel import offload


class Matrices(nn.Module):
    """`n` parameters as matrices of up to 4096 x 14336 (an 8B model's MLP), the last one smaller."""

    def __init__(self, n: int):
        super().__init__()
        full, left = divmod(n, 4096 * 14336)
        shapes = [(4096, 14336)] * full + ([(left // 64 or 1, 64)] if left else [])
        self.ws = nn.ParameterList(nn.Parameter(torch.empty(s)) for s in shapes)


def make(n: int, device: torch.device, threaded: bool) -> offload.OptimizerOffload:
    torch.manual_seed(0)
    model = Matrices(n)
    for w in model.ws:
        nn.init.normal_(w, std=0.02)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = offload.place_model(model, device, dtype)
    o = offload.OptimizerOffload(model, [{"params": list(model.parameters()), "weight_decay": 0.1}], 3e-4,
                                 (0.9, 0.95), 1e-8)
    o.layered = threaded  # the thread the layer-by-layer schedule steps in
    g = torch.Generator().manual_seed(1)
    for s in o.sums:
        s.copy_(torch.randn(s.shape, generator=g))
    return o


def kiln_step(o: offload.OptimizerOffload, max_norm: float) -> float:
    o.summed = [True] * len(o.params)
    t = time.perf_counter()
    o.step(max_norm)
    o.settle()
    if o.streams:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def torch_step(o: offload.OptimizerOffload, opt: torch.optim.AdamW, max_norm: float) -> float:
    """The former host step: norm, clipping as a pass of its own, torch's fused AdamW over whole tensors, the
    weights copied to the device."""
    for m, s in zip(o.masters, o.sums):
        m.grad = s
    t = time.perf_counter()
    norm = nn.utils.get_total_norm(o.sums, 2.0)
    nn.utils.clip_grads_with_norm_(o.masters, max_norm, norm)
    opt.step()
    o._send(list(range(len(o.params))))
    if o.streams:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e9)
    ap.add_argument("--steps", type=int, default=3, help="steps timed of each variant (the median), after one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--thread-teams", default="",
                    help="comma-separated OpenMP team sizes to time the threaded step with besides its default "
                         "(three quarters of the process's threads), e.g. 24,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n, dev = int(args.params), torch.device(args.device)
    info = run_info(dev, params=n, steps=args.steps, threads=torch.get_num_threads())
    max_norm = 1e-3  # every step clips
    rows, finals = [], {}
    variants = [("torch AdamW(fused=True), clip pass before", None, 0), ("kiln offload step", False, 0),
                ("kiln offload step, in its thread", True, 0)]
    variants += [(f"kiln offload step, in its thread of {t}", True, t)
                 for t in map(int, filter(None, args.thread_teams.split(",")))]
    for name, threaded, team in variants:
        o = make(n, dev, bool(threaded))
        o._threads = team or o._threads
        if threaded is None:
            opt = torch.optim.AdamW(o.masters, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
            times = [torch_step(o, opt, max_norm) for _ in range(args.steps + 1)][1:]
        else:
            times = [kiln_step(o, max_norm) for _ in range(args.steps + 1)][1:]
        s = statistics.median(times)
        rows.append({"name": name, "s": s, "gbs": 28 * n / s / 1e9})
        finals[name] = torch.cat([m.view(-1)[:1 << 20] for m in o.masters])
        print(f"{name}: {s:.3f} s a step", flush=True)
        o.close()
        del o
    first = next(iter(finals.values()))
    same = all(torch.equal(first, f) for f in finals.values())
    print(json_line := f"weights after {args.steps + 1} steps bit-identical across variants: {same}")
    print(table(rows, [("host step", "name"), ("s", "s", ".3f"), ("GB/s at 28 B/param", "gbs", ".1f"),
                       ("vs torch", lambda r: rows[0]["s"] / r["s"], "{:.2f}x")]))
    print(f"{n / 1e9:.2f}B parameters, {torch.get_num_threads()} threads, {info['device']}")
    write_json(args.json, {**info, "results": rows, "identical": same, "note": json_line})


if __name__ == "__main__":
    main()
