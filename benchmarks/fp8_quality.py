"""Does float8 train as well as bf16? Two real `kiln train` runs of the same config from the same seed over real
text, one in bf16 and one with train.fp8, each in its own process pinned to its own GPU, side by side.

    python benchmarks/fp8_quality.py --gpus 0,1 --out benchmarks/results/fp8_quality_1b_h100

The text is this machine's Python source (the standard library and installed packages, as
benchmarks/real_run.py reads it), prepared once with `kiln prepare` (Kiln's BPE, shards, a validation split)
before both runs start. Defaults: the gpu-1b preset at sequence 1024, micro-batch 4 (4,096 tokens a step),
2,000 steps, a validation loss every 100 steps; no checkpoints (the runs measure the loss, not the saves).

Writes <out>.jsonl (every logged training loss and every validation loss of both runs), <out>.csv (the two
curves by step), <out>.png (both curves; needs matplotlib) and <out>.json (the final validation losses, their
gap as a share of bf16's, the largest training loss after warm-up of each, and whether any was not finite),
and prints the table. --sides names the two runs: bf16, fp32, fp8 (tensorwise) or fp8-rowwise; the CPU
smoke run of the test suite compares fp32 with bf16 on the CPU (no float8 there).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/fp8_quality.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import time

from benchmarks.common import run_info, table, write_json
from benchmarks.real_run import KILN, data_overrides

SIDES = {"bf16": ["train.precision=bf16"], "fp32": ["train.precision=fp32"],
         "fp8": ["train.precision=bf16", "train.fp8.enabled=true", "train.fp8.recipe=tensorwise"],
         "fp8-rowwise": ["train.precision=bf16", "train.fp8.enabled=true", "train.fp8.recipe=rowwise"]}


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return ([{"step": r["step"], "loss": r["loss"]} for r in rows if r.get("event") == "train"],
            [{"step": r["step"], "val_loss": r["val_loss"]} for r in rows if r.get("event") == "eval"])


def summary(name: str, train: list[dict], evals: list[dict], warmup: int) -> dict:
    after = [r["loss"] for r in train if r["step"] > warmup] or [r["loss"] for r in train]
    losses = [r["loss"] for r in train] + [e["val_loss"] for e in evals]
    return {"run": name, "steps": train[-1]["step"] if train else 0,
            "first_val_loss": evals[0]["val_loss"] if evals else None,
            "final_val_loss": evals[-1]["val_loss"] if evals else None,
            "final_train_loss": train[-1]["loss"] if train else None,
            "max_train_loss_after_warmup": max(after) if after else None,
            "finite": all(math.isfinite(v) for v in losses)}


def write_curves(out: Path, names: list[str], runs: dict[str, tuple[list[dict], list[dict]]]) -> None:
    with open(out.with_suffix(".jsonl"), "w") as f:
        for name in names:
            train, evals = runs[name]
            for r in train:
                f.write(json.dumps({"run": name, "event": "train", **r}) + "\n")
            for r in evals:
                f.write(json.dumps({"run": name, "event": "eval", **r}) + "\n")
    steps = sorted({r["step"] for n in names for r in runs[n][0]} | {r["step"] for n in names for r in runs[n][1]})
    by = {n: ({r["step"]: r["loss"] for r in runs[n][0]}, {r["step"]: r["val_loss"] for r in runs[n][1]})
          for n in names}
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *(f"{n}_loss" for n in names), *(f"{n}_val_loss" for n in names)])
        for s in steps:
            w.writerow([s, *(by[n][0].get(s, "") for n in names), *(by[n][1].get(s, "") for n in names)])


def plot(out: Path, names: list[str], runs: dict, gap: float | None) -> str | None:
    """The curves as <out>.png; None if drawn, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kiln[plot]')"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, color in zip(names, ("tab:blue", "tab:orange")):
        train, evals = runs[name]
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], color=color, alpha=0.35, lw=1,
                label=f"{name} train")
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], color=color, marker="o", ms=3, lw=1.5,
                label=f"{name} validation")
    title = " vs ".join(names) + (f": final validation gap {gap:+.2%}" if gap is not None else "")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpu-1b", help="preset or YAML file both runs train")
    p.add_argument("--sides", default="bf16,fp8", help=f"the two runs, of {', '.join(SIDES)}")
    p.add_argument("--gpus", default="0,1", help="the GPU of each run (CUDA_VISIBLE_DEVICES), or 'cpu'")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-bytes", type=int, default=60_000_000, help="characters of source to read")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--sources", default=None, help="comma-separated files or globs of text (default: the Python "
                   "source of this machine, as benchmarks/real_run.py reads it)")
    p.add_argument("--cache", default=".kiln-cache", help="data.cache_dir (prepared data is reused from here)")
    p.add_argument("--out", default="benchmarks/results/fp8_quality", help="path of the results, without suffix")
    p.add_argument("--runs", default="runs/fp8_quality", help="where the two run directories and their logs go")
    p.add_argument("extra", nargs="*", help="more KEY=VALUE overrides for both runs")
    a = p.parse_args(argv)
    names = a.sides.split(",")
    if len(names) != 2 or any(n not in SIDES for n in names) or names[0] == names[1]:
        p.error(f"--sides takes two different runs of {', '.join(SIDES)}")
    gpus = ["cpu", "cpu"] if a.gpus == "cpu" else a.gpus.split(",")
    if len(gpus) != 2:
        p.error("--gpus takes two GPUs (0,1) or 'cpu'")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(a.runs)

    data = data_overrides(a.max_bytes, a.cache, a.vocab)
    if a.sources:
        data = [f"data.sources={json.dumps(a.sources.split(','))}", *data[1:]]
    t = time.perf_counter()
    subprocess.run([*KILN, "prepare", a.config, *data], check=True)
    print(f"prepare: {time.perf_counter() - t:.0f} s", flush=True)
    common = [*data, f"train.max_steps={a.steps}", f"train.seq_len={a.seq}", f"train.batch_size={a.batch}",
              "train.grad_accum=1", f"train.warmup_steps={a.warmup}", f"train.eval_every={a.eval_every}",
              "train.eval_batches=10", "train.sample_tokens=0", "train.seed=1337",
              "train.device=" + ("cpu" if gpus[0] == "cpu" else "cuda"), "checkpoint.every=0",
              "checkpoint.at_end=false", "checkpoint.save_final=false", "logging.every=10", "logging.console=false",
              "logging.plots=false", *a.extra]
    root.mkdir(parents=True, exist_ok=True)
    procs, t = {}, time.perf_counter()
    for name, gpu in zip(names, gpus):
        env = {**os.environ, **({} if gpu == "cpu" else {"CUDA_VISIBLE_DEVICES": gpu})}
        run_dir = root / name
        log = open(root / f"{name}.log", "w")
        shutil.rmtree(run_dir, ignore_errors=True)  # this script's own run of before: both start afresh
        cmd = [*KILN, "train", a.config, *common, *SIDES[name], f"train.run_dir={run_dir}"]
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, run_dir)
    failed = []
    for name, (proc, log, _) in procs.items():
        if proc.wait():
            failed.append(name)
        log.close()
    wall = time.perf_counter() - t
    if failed:
        for name in failed:
            print(f"--- {name} failed; the end of {root / (name + '.log')}:\n"
                  + (root / f"{name}.log").read_text()[-3000:], file=sys.stderr)
        sys.exit(f"failed: {', '.join(failed)}")

    runs = {name: records(procs[name][2]) for name in names}
    rows = [summary(name, *runs[name], a.warmup) for name in names]
    base, other = rows[0]["final_val_loss"], rows[1]["final_val_loss"]
    gap = (other - base) / base if base and other is not None else None
    write_curves(out, names, runs)
    why_no_plot = plot(out, names, runs, gap)
    result = {"env": run_info(None, packages=["torchao"], gpus=gpus, wall_s=wall), "argv": argv or sys.argv[1:],
              "config": a.config, "sides": names, "steps": a.steps, "seq": a.seq, "batch": a.batch,
              "runs": rows, "final_val_gap": gap, "within_1_percent": gap is not None and abs(gap) <= 0.01,
              "plot": None if why_no_plot else str(out.with_suffix(".png"))}
    write_json(out.with_suffix(".json"), result)
    print(table(rows, [("run", "run"), ("steps", "steps"), ("first val", "first_val_loss", ".4f"),
                       ("final val", "final_val_loss", ".4f"), ("final train", "final_train_loss", ".4f"),
                       ("max train after warm-up", "max_train_loss_after_warmup", ".3f"), ("finite", "finite")]))
    print(f"final validation loss, {names[1]} against {names[0]}: "
          + (f"{gap:+.3%}" if gap is not None else "-") + f"; wall {wall:.0f} s for both; curves: {out}.csv, "
          + (f"{out}.png" if not why_no_plot else f"no plot ({why_no_plot})"))
    return result


if __name__ == "__main__":
    main()
