"""Where a step's GPU time goes, from a torch.profiler Chrome trace (`kiln train ... profile.steps=3`).

    python benchmarks/trace_summary.py RUN/profile/steps-30-32.pt.trace.json [OTHER.json] [--json out.json]

For each trace, per recorded step (milliseconds): the GPU span of the step, the time any kernel ran
(busy) and none did (idle), the kernel time of each kind (matmul, attention, NCCL, ...), and how much of the
NCCL time ran beside compute kernels (overlapped) or alone (exposed). With two traces (one GPU, then
several), it also lists the kernels, and the host operators (self time on the CPU threads), whose time per
step changed most: where the second run loses time, on the GPU or on the host that feeds it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/trace_summary.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import re
from collections import defaultdict

KINDS = [  # (kind, pattern on the kernel's name), first match wins
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|attn"),
    ("matmul", r"gemm|nvjet|sm90_xmma|cutlass|cublas|wgmma"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("triton", r"triton"),
    ("copy", r"^Memcpy|^Memset|copy|cat"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted, disjoint span lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def host_self_times(events: list[dict]) -> dict[str, float]:
    """Self time (microseconds) of each host operator name: its span less the spans of the operators nested
    in it on the same thread."""
    out: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "cuda_runtime", "cuda_driver"):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        stack: list[list] = []  # [end, name, self time]
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0] <= e["ts"]:
                end, name, own = stack.pop()
                out[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"][:90], e["dur"]])
        for _, name, own in stack:
            out[name] += own
    return out


def idle_gaps(kernels: list[dict], n_steps: int, top: int = 8) -> dict[str, float]:
    """Idle GPU time (ms per step) by the kernel that ends each gap: where the GPU waits for the host (before
    the first kernel of a step: the step's start; before an optimizer kernel: the backward pass's end...)."""
    out: dict[str, float] = defaultdict(float)
    end = None
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if end is not None and k["ts"] > end:
            out[k["name"][:60]] += (k["ts"] - end) * 1e-3 / n_steps
        end = max(end or 0.0, k["ts"] + k["dur"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])


def summarize(path: str) -> dict:
    events = json.loads(Path(path).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"
             and str(e.get("name", "")).startswith("ProfilerStep#")]
    cpu_steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                 and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not kernels:
        raise SystemExit(f"{path}: no GPU kernels in this trace (a CPU run?)")
    lo, hi = min(k["ts"] for k in kernels), max(k["ts"] + k["dur"] for k in kernels)
    n = max(1, len(steps) or len(cpu_steps))
    spans = {"all": [], "compute": [], "nccl": []}
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    streams: dict[int, float] = defaultdict(float)
    for k in kernels:
        s = (k["ts"], k["ts"] + k["dur"])
        kind = kind_of(k["name"])
        per_kind[kind] += k["dur"]
        per_kernel[k["name"][:90]] += k["dur"]
        streams[int(k.get("args", {}).get("stream", -1))] += k["dur"]
        spans["all"].append(s)
        spans["nccl" if kind == "nccl" else "compute"].append(s)
    busy = {key: union(v) for key, v in spans.items()}
    ms = 1e-3 / n  # microseconds in the trace -> milliseconds per step
    overlap = intersect(busy["nccl"], busy["compute"])
    return {
        "trace": str(path), "steps": n, "kernels": len(kernels),
        "span_ms": (hi - lo) * ms,
        "cpu_step_ms": sum(e["dur"] for e in cpu_steps) * 1e-3 / max(1, len(cpu_steps)),
        "busy_ms": length(busy["all"]) * ms, "idle_ms": ((hi - lo) - length(busy["all"])) * ms,
        "compute_busy_ms": length(busy["compute"]) * ms,
        "nccl_ms": length(busy["nccl"]) * ms, "nccl_overlapped_ms": overlap * ms,
        "nccl_exposed_ms": (length(busy["nccl"]) - overlap) * ms,
        "kinds_ms": {k: v * ms for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "streams_ms": {str(k): v * ms for k, v in sorted(streams.items(), key=lambda kv: -kv[1])},
        "kernels_ms": {k: v * ms for k, v in per_kernel.items()},
        "host_ms": {k: v * ms for k, v in host_self_times(events).items()},
        "idle_before_ms": idle_gaps(kernels, n),
    }


def table(rows: list[dict]) -> str:
    keys = ["span_ms", "cpu_step_ms", "busy_ms", "idle_ms", "compute_busy_ms", "nccl_ms", "nccl_overlapped_ms",
            "nccl_exposed_ms"]
    kinds = sorted({k for r in rows for k in r["kinds_ms"]}, key=lambda k: -rows[0]["kinds_ms"].get(k, 0.0))
    head = "| ms per step | " + " | ".join(Path(r["trace"]).parent.parent.name or r["trace"] for r in rows) + " |"
    lines = [head, "| --- |" + " ---: |" * len(rows)]
    for key in keys:
        lines.append(f"| {key[:-3]} | " + " | ".join(f"{r[key]:.2f}" for r in rows) + " |")
    for k in kinds:
        lines.append(f"| kernels: {k} | " + " | ".join(f"{r['kinds_ms'].get(k, 0.0):.2f}" for r in rows) + " |")
    return "\n".join(lines)


def deltas(a: dict, b: dict, key: str = "kernels_ms", top: int = 12) -> str:
    names = set(a[key]) | set(b[key])
    diff = sorted(names, key=lambda k: -abs(b[key].get(k, 0.0) - a[key].get(k, 0.0)))[:top]
    what = "kernel" if key == "kernels_ms" else "host operator (self time)"
    lines = [f"| {what} | first (ms/step) | second | change |", "| --- | ---: | ---: | ---: |"]
    for k in diff:
        x, y = a[key].get(k, 0.0), b[key].get(k, 0.0)
        lines.append(f"| `{k[:70]}` | {x:.3f} | {y:.3f} | {y - x:+.3f} |")
    return "\n".join(lines)


def report(rows: list[dict]) -> str:
    """The summaries side by side; with two or more, the kernels and host operators of the first two whose time
    changed most; then each trace's idle GPU time by the kernel that ends it."""
    parts = [table(rows)]
    if len(rows) >= 2:
        parts += [deltas(rows[0], rows[1]), deltas(rows[0], rows[1], "host_ms")]
    for r in rows:
        parts.append(f"{Path(r['trace']).parent.parent.name}: idle GPU time (ms per step) before the kernel that "
                     "ends it\n" + "\n".join(f"  {v:7.3f}  {name}" for name, v in r["idle_before_ms"].items()))
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", default=None, help="write the summaries (without per-kernel times) here")
    args = ap.parse_args()
    rows = [summarize(t) for t in args.traces]
    print(report(rows))
    if args.json:
        slim = [{k: v for k, v in r.items() if k not in ("kernels_ms", "host_ms")} for r in rows]
        Path(args.json).write_text(json.dumps(slim, indent=1) + "\n")


if __name__ == "__main__":
    main()
