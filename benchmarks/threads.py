"""CPU threads: a training step and `kiln generate` of small models with 1, 2, ... PyTorch threads, side by side.

    python benchmarks/threads.py                                # quickstart model and tiny, 1 vs 2 threads
    python benchmarks/threads.py --models 256x4,512x8 --threads 1,2 --rounds 8

Each model `DxL` is Kiln's Transformer (d_model D, L layers, 4 heads, vocab 4096) trained through
Kiln's own `Trainer.train_step` on random tokens with document masks (quickstart: seq 256, batch 8),
and sampled through `kiln.model.generate` (one sequence, --gen-tokens tokens). Thread counts are
interleaved round by round, so a neighbour's load on a shared machine hits all of them alike; the
median per step (or per generated token) is printed with the load average before and after.
Results of the default choice of `train.threads`: benchmarks/results/threads.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/threads.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import seconds_per_call
from benchmarks.synthetic import random_loader
from kiln.config import RunConfig
from kiln.model.generate import generate
from kiln.model.llama import Transformer
from kiln.model.registry import param_count
from kiln.train.trainer import Trainer


def build(d: int, layers: int, seq: int, batch: int, data: str) -> Trainer:
    """Kiln's Trainer of a DxL model over Kiln's loader of random tokens (4 documents a row) written under `data`."""
    cfg = RunConfig.model_validate({"model": {"d_model": d, "n_layers": layers, "n_heads": 4, "vocab_size": 4096},
                                    "train": {"seq_len": seq, "batch_size": batch}})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    loader = random_loader(data, batch, seq, 4096, docs_per_row=4, prefetch=0)
    return Trainer(cfg, model, loader, None, torch.device("cpu"))


def time_steps(trainer: Trainer, steps: int) -> float:
    return seconds_per_call(lambda: float(trainer.train_step()[0]), steps)


def time_generate(trainer: Trainer, tokens: int) -> float:
    t0 = time.perf_counter()
    generate(trainer.model, list(range(1, 17)), tokens, seed=0)
    return (time.perf_counter() - t0) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="256x4,64x2", help="DxL list (default: the quickstart model and tiny)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="train steps timed per round")
    ap.add_argument("--gen-tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, default threads {torch.get_num_threads()}, "
          f"load average before {os.getloadavg()}")
    for spec in args.models.split(","):
        d, layers = (int(x) for x in spec.split("x"))
        data = tempfile.TemporaryDirectory()
        trainer = build(d, layers, args.seq, args.batch, data.name)
        n = param_count(trainer.model.cfg)
        step: dict[int, list[float]] = {c: [] for c in counts}
        tok: dict[int, list[float]] = {c: [] for c in counts}
        for c in counts:  # warm up every thread count once
            torch.set_num_threads(c)
            time_steps(trainer, 1)
            time_generate(trainer, 4)
        for r in range(args.rounds):
            for c in (counts if r % 2 == 0 else counts[::-1]):
                torch.set_num_threads(c)
                step[c].append(time_steps(trainer, args.steps))
                tok[c].append(time_generate(trainer, args.gen_tokens))
        base = counts[0]
        print(f"model d={d} L={layers} ({n / 1e6:.2f}M parameters), seq {args.seq}, batch {args.batch}:")
        for c in counts:
            ms, gs = statistics.median(step[c]) * 1e3, statistics.median(tok[c]) * 1e3
            rel_s = statistics.median(step[base]) / statistics.median(step[c])
            rel_g = statistics.median(tok[base]) / statistics.median(tok[c])
            print(f"  {c} thread(s): train step {ms:8.1f} ms (x{rel_s:.2f} vs {base})   "
                  f"generate {gs:6.2f} ms/token (x{rel_g:.2f} vs {base})   "
                  f"step min/max {min(step[c]) * 1e3:.0f}/{max(step[c]) * 1e3:.0f} ms")
        data.cleanup()
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
