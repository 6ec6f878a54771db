"""Where a job's first steps go: `kiln train` with every step logged, its Python stacks sampled, and its
recompilations listed, so a slow step after the first (compile) shows what it waited on.

    python benchmarks/warmup.py gpu-1b --steps 5                      # one GPU
    python benchmarks/warmup.py gpu-1b --steps 5 --nproc 2 dist.strategy=fsdp

Every process of the job writes the stack of its main thread every --every seconds (a thread started by a
sitecustomize on PYTHONPATH), into one file per process. Printed: each step's wall time since the
previous step's record and its data-wait share (metrics.jsonl), the recompilations (TORCH_LOGS=recompiles),
and for each step slower than --slow times the median, the innermost frames seen most often in rank 0's
samples taken during it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/warmup.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import collections
import json
import os
import statistics
import subprocess
import tempfile
import time

SITE = """import os, sys, threading, time, traceback
def _sample(path=os.path.join({out!r}, f"stacks-{{os.getpid()}}-{{os.environ.get('RANK', 'x')}}.txt")):
    main = threading.main_thread().ident
    with open(path, "w") as f:
        while True:
            time.sleep({every})
            frame = sys._current_frames().get(main)
            if frame is not None:
                inner = [f"{{x.filename}}:{{x.lineno}} {{x.name}}" for x in reversed(traceback.extract_stack(frame))]
                f.write(f"{{time.time():.3f}} " + " | ".join(inner) + "\\n")
                f.flush()
threading.Thread(target=_sample, daemon=True).start()
"""


def samples(path: Path) -> list[tuple[float, list[str]]]:
    """(time, frames of the main thread, innermost first) of each sample in one process's file."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        t, _, frames = line.partition(" ")
        out.append((float(t), frames.split(" | ")))
    return out


def where(frames: list[str]) -> str:
    """A sample in short: its two innermost frames, and the innermost of Kiln's own that called them."""
    short = [f.split("site-packages/")[-1].split("/src/")[-1] for f in frames]
    own = next((f for f in short if f.startswith("kiln/")), "")
    return " <- ".join(short[:2]) + (f" ... {own}" if own and own not in short[:2] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between stack samples")
    ap.add_argument("--slow", type=float, default=3.0, help="a step this many times the median is explained")
    args = ap.parse_intermixed_args()  # overrides may follow the options
    with tempfile.TemporaryDirectory() as tmp:
        site, stacks, run_dir = Path(tmp) / "site", Path(tmp) / "stacks", Path(tmp) / "run"
        site.mkdir()
        stacks.mkdir()
        (site / "sitecustomize.py").write_text(SITE.format(out=str(stacks), every=args.every))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
               "TORCH_LOGS": "recompiles", "PYTHONUNBUFFERED": "1"}
        nproc = ["--nproc", str(args.nproc)] if args.nproc > 1 else []
        cmd = [sys.executable, "-m", "kiln.cli", "train", args.config, f"train.run_dir={run_dir}",
               f"train.max_steps={args.steps}", "logging.every=1", "train.sample_tokens=0", "checkpoint.every=100000",
               "checkpoint.save_final=false", *args.overrides, *nproc]
        t0 = time.time()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(f"exit {done.returncode} after {time.time() - t0:.1f} s: {' '.join(cmd[2:])}")
        log = done.stdout + done.stderr
        recompiles = [line for line in log.splitlines() if "Recompiling function" in line or "guard failure" in line
                      or line.strip().startswith("- ")]
        print(f"recompilations ({sum('Recompiling function' in x for x in recompiles)}):")
        for line in recompiles[:40]:
            print("  " + line.split("]")[-1].strip()[:160])
        if done.returncode != 0:
            print(log[-4000:])
        path = run_dir / "metrics.jsonl"
        recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        train = {r["step"]: r for r in recs if r.get("event") == "train"}
        marks = [(r.get("event"), r.get("step"), r["time"]) for r in recs if "time" in r]
        print("records: " + ", ".join(f"{e} {s} at +{t - t0:.1f} s" for e, s, t in marks))
        walls = {s: train[s]["time"] - train[s - 1]["time"] for s in train if s - 1 in train}
        median = statistics.median(walls.values()) if walls else 0.0
        # rank 0 of a job of several processes (the launcher and torchrun have no RANK), else the one process
        rank0 = list(stacks.glob("stacks-*-0.txt")) or list(stacks.glob("stacks-*-x.txt"))
        taken = sorted((t, f) for p in rank0 for t, f in samples(p))
        print(f"{'step':>5} {'wall s':>8} {'data wait':>10}")
        for s in sorted(train):
            wall = walls.get(s)
            print(f"{s:>5} {wall if wall is not None else float('nan'):>8.2f} {train[s].get('data_wait', 0):>10.3f}")
            start = train[s - 1]["time"] if s - 1 in train else t0
            if wall is None and s == min(train):
                wall = train[s]["time"] - t0
            if wall and median and wall > args.slow * median:
                seen = collections.Counter(where(f) for t, f in taken if start <= t <= train[s]["time"])
                for frames, n in seen.most_common(6):
                    print(f"        {n} x {frames[:400]}")


if __name__ == "__main__":
    main()
