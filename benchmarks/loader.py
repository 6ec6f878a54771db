"""Packed-row throughput of the loader on one CPU core, beside nanoGPT's random-window sampler.

    python -m benchmarks.loader                       # synthetic shards, web-like document lengths
    python -m benchmarks.loader --dataset DIR         # a dataset made by `kiln prepare`

Both read the same memory-mapped uint16 shards and produce int64 (B, T) inputs and targets. Kiln
also gives document ids (for attention masking), keeps an exact resumable position and visits
every token once per epoch; the baseline samples random offsets (tokens repeat and are missed) and
yields no document boundaries.

Goal: at least 50 million tokens/s on one core (`--min-rate`) for every document length: below it the
script says so and exits with status 1. Rates are tokens per second of this thread's CPU time (what one
core does, whatever else shares the machine); wall-clock rates are printed beside them.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/loader.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import run_info, write_json
from benchmarks.synthetic import random_shards
from kiln.data.format.shards import TokenStream
from kiln.data.load.loader import PackedLoader


def nanogpt_batches(data: np.ndarray, T: int, B: int, seed: int = 0):
    """The random-window sampler of nanoGPT's train.py (re-implemented): B random offsets per batch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        ix = torch.randint(len(data) - T, (B,), generator=gen)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix.tolist()])
        yield x, y


def rate(it, tokens_per_batch: int, seconds: float) -> tuple[float, float]:
    """(tokens per CPU second of this thread, tokens per wall-clock second) over `seconds` of CPU time."""
    next(it)  # warm up
    n, c0, t0 = 0, time.thread_time(), time.perf_counter()
    while time.thread_time() - c0 < seconds:
        next(it)
        n += 1
    return n * tokens_per_batch / (time.thread_time() - c0), n * tokens_per_batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", help="a prepared dataset directory (default: synthetic shards)")
    ap.add_argument("--tokens", type=int, default=60_000_000, help="synthetic stream size")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--min-rate", type=float, default=50e6,
                    help="fail (exit 1) if Kiln's loader makes fewer tokens per CPU second than this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    T, B = args.seq_len, args.batch_size
    results, slow = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        if args.dataset:
            from kiln.data.format.dataset import open_dataset

            ds = open_dataset(args.dataset)
            cases = {"dataset": (ds.shards("train"), ds.dtype)}
        else:
            cases = {f"docs~{m}": (random_shards(Path(tmp) / f"m{m}", args.tokens, 50_000, m), np.uint16)
                     for m in (1000, 100)}
        for name, (shards, dtype) in cases.items():
            stream = TokenStream(shards, dtype, name=name)
            flat = np.concatenate([np.memmap(b, dtype=dtype, mode="r") for b, _, _ in shards])
            rates = {
                "kiln (doc ids)": rate(PackedLoader(stream, T, B, prefetch=0), B * T, args.seconds),
                "kiln (no doc ids)": rate(PackedLoader(stream, T, B, prefetch=0, document_mask=False), B * T,
                                          args.seconds),
                "nanoGPT get_batch": rate(nanogpt_batches(flat, T, B), B * T, args.seconds),
            }
            row = {k: cpu for k, (cpu, _) in rates.items()}
            results[name] = row
            results[name + " (wall clock)"] = {k: wall for k, (_, wall) in rates.items()}
            print(f"{name}: {len(stream):,} tokens, {stream.documents:,} documents, T={T}, B={B}, 1 thread")
            for k, (cpu, wall) in rates.items():
                print(f"  {k:20s} {cpu / 1e6:8.1f} M tokens/s   ({wall / 1e6:.1f} M per wall-clock second)")
            print(f"  ratio kiln (doc ids) / nanoGPT: {row['kiln (doc ids)'] / row['nanoGPT get_batch']:.2f}x")
            slow += [f"{name}, {k}: {v / 1e6:.1f} M tokens/s" for k, v in row.items()
                     if k.startswith("kiln") and v < args.min_rate]
    write_json(args.out, run_info(torch.device("cpu"), ["numpy"], seq_len=T, batch_size=B, results=results))
    if slow:
        sys.exit(f"FAILED: the loader is under the goal of {args.min_rate / 1e6:.0f} M tokens/s per core "
                 f"(numpy {np.__version__}):\n  " + "\n  ".join(slow))
    print(f"ok: every Kiln rate is at least {args.min_rate / 1e6:.0f} M tokens/s per core")


if __name__ == "__main__":
    main()
