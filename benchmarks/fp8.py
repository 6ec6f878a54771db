"""Float8 training (train.fp8) against bf16: the same model, batch, activation checkpointing and compile, in one
process on one GPU, one run after the other.

    python benchmarks/fp8.py --size 1b --batch 8 --seq 2048 --json benchmarks/results/fp8_1b_h100.json

Each run builds Kiln's model as `kiln train` does (kiln.parallel.parallelize: float8 layers, AC, per-block
compile) and trains it through Kiln's own `Trainer.train_step` on random tokens read by Kiln's loader
(benchmarks.synthetic): `--warmup` steps (compilation included), then `--steps` timed between two device
synchronisations. It prints tokens/s, MFU, peak memory and each run's ratio to bf16.

MFU counts 6*N + 12*L*d*T FLOPs per token (kiln.model.registry.flops_per_token) against the card's dense **bf16**
peak (989 TFLOP/s on H100/H200) for every run, fp8 included: the fp8 rows' MFU is the bf16 one times their
speed-up, comparable across rows (against the float8 peak, twice the bf16 one, it would be half).

Without a GPU with float8 (compute capability 8.9+) the fp8 runs are left out and said so (the CPU smoke run of
the test suite runs the bf16 path alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/fp8.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import tempfile
from dataclasses import asdict

import torch

from benchmarks.common import free, run_info, table, write_json
from benchmarks.synthetic import random_loader
from benchmarks.throughput import VOCAB, Result, _time_kiln
from kiln.config import RunConfig
from kiln.config.load import _apply_override
from kiln.model.llama import Transformer
from kiln.model.registry import flops_per_token
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import parallelize


def fp8_problem(device: torch.device) -> str | None:
    """Why this device cannot run the fp8 rows (None if it can)."""
    from kiln.parallel.float8 import device_problem

    problem = device_problem(device)
    if problem is None:
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            problem = "torchao is not installed (pip install 'kiln[fp8]')"
    return problem


def run(mode: str, size: str, batch: int, seq: int, warmup: int, steps: int, ac: str, compile: bool,
        device: torch.device, vocab: int = VOCAB, sets: tuple[str, ...] = (), profile: bool = False) -> Result:
    """One run: mode 'bf16' or 'fp8-tensorwise' / 'fp8-rowwise'; `sets`: config overrides (KEY=VALUE, as kiln
    train takes them) for every run; `profile`: print the GPU kernels that took the most time over three steps."""
    free()
    recipe = mode.partition("-")[2] or "tensorwise"
    data = {
        "model": {"size": size, "vocab_size": vocab, "max_seq_len": max(seq, 2048)},
        "train": {"batch_size": batch, "seq_len": seq, "max_steps": warmup + steps, "warmup_steps": 2, "lr": 3e-4,
                  "precision": "bf16", "compile": compile, "activation_checkpointing": ac, "device": device.type,
                  "fp8": {"enabled": mode != "bf16", "recipe": recipe}},
        "logging": {"console": False, "jsonl": False},
    }
    for item in sets:
        _apply_override(data, item)
    cfg = RunConfig.model_validate(data)
    torch.manual_seed(0)
    said: list[str] = []
    model = parallelize(Transformer(cfg.model), cfg, Mesh(device=device), log=said.append)
    fpt = flops_per_token(cfg.model, seq)
    from kiln.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        loader = random_loader(tmp, batch, seq, vocab)
        try:
            trainer = Trainer(cfg, model, loader, None, device, [], flops_per_token=fpt)
            res = _time_kiln(Result(mode, size, batch, seq), trainer, fpt, warmup, steps, "default", None, profile)
        finally:
            loader.close()
    res.notes = (f"compile={compile} ac={ac}" + "".join(f" {s}" for s in sets)
                 + "".join(f"; {s}" for s in said if s.startswith("train.fp8")))
    return res


def measure(mode: str, *args, **kw) -> Result:
    """`run`'s result, or one that says why it has none (the other rows still come)."""
    try:
        res = run(mode, *args, **kw)
    except torch.OutOfMemoryError:
        res = Result(mode, args[0], args[1], args[2], notes="out of memory")
    except Exception as e:  # noqa: BLE001 (in the table and the exit status)
        res = Result(mode, args[0], args[1], args[2], notes=f"failed: {type(e).__name__}: {e}"[:300])
    print(json.dumps(asdict(res)), flush=True)
    return res


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--ac", default="none", choices=["none", "selective", "full"])
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--recipes", default="tensorwise,rowwise", help="fp8 recipes measured beside bf16")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run, e.g. train.compile_scope=model (repeatable)")
    p.add_argument("--profile", action="store_true", help="print each run's top GPU kernels over three more steps")
    p.add_argument("--json", help="write every result here as JSON")
    a = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    modes = ["bf16"] + [f"fp8-{r}" for r in filter(None, a.recipes.split(","))]
    missing = fp8_problem(device)
    if missing:
        print(f"fp8 runs left out: {missing}", flush=True)
        modes = ["bf16"]
    results = [measure(m, a.size, a.batch, a.seq, a.warmup, a.steps, a.ac, bool(a.compile), device, a.vocab,
                       tuple(a.set), a.profile) for m in modes]

    env = run_info(device, packages=["torchao"], fp8_left_out=missing)
    write_json(a.json, {"env": env, "argv": argv or sys.argv[1:], "results": [asdict(r) for r in results]})
    print(f"\n{env}")
    base = results[0]
    print(table([asdict(r) for r in results], [
        ("run", "name"), ("model", "size"), ("seq", "seq"), ("batch", "batch"),
        ("tokens/s", "tokens_per_s", ",.0f"), ("MFU (bf16 peak)", "mfu", ".1%"), ("peak GiB", "peak_gib", ".1f"),
        ("speed vs bf16", lambda r: r["tokens_per_s"] / base.tokens_per_s if base.tokens_per_s and r["tokens_per_s"]
         else None, "{:.2f}x"),
        ("memory vs bf16", lambda r: r["peak_gib"] / base.peak_gib if base.peak_gib and r["peak_gib"] else None,
         "{:.2f}x"),
        ("loss", "last_loss", ".3f"), ("notes", lambda r: r["notes"] if not r["tokens_per_s"] else "")]))
    failed = [r.name for r in results if not r.tokens_per_s]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
    return results


if __name__ == "__main__":
    main()
