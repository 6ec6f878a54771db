"""Data-parallel scaling: `kiln train` on N GPUs beside the same config on one GPU, in one call.

    python benchmarks/scaling.py --config gpu-124m --runs 1:ddp,2:ddp,2:fsdp --steps 120 --json out.json
    python benchmarks/scaling.py --runs "1:auto,2:solo,2:ddp,2:ddp:recovery.rollback=false"   # where scaling goes

A run is NPROC:STRATEGY[:KEY=VALUE;KEY=VALUE] (overrides of that run alone; an upper-case KEY, such as
NCCL_MAX_NCHANNELS, is set in that run's environment instead); STRATEGY `solo` starts NPROC independent
one-GPU jobs at once and adds their rates (the machine's own limit, without communication).
`--profile S` records steps S to S+2 of every run (rank 0) and prints where their GPU time went
(benchmarks.trace_summary), each run beside the first. `--repeat R` runs the list R times in rounds and
gives each run's median: the one-GPU baseline moves by a few percent between runs.

Each run is a real `kiln train` (torchrun started by `--nproc N` when N > 1) on the preset's data, with
`train.batch_size` per GPU kept, so the global batch grows with N (weak scaling, as data-parallel
training is used). Tokens/s is the median of the logged `tokens_per_s` (the whole job) after the first
quarter of the steps (compile and warm-up excluded). Prints a table with the speed-up over the one-GPU
run and the scaling efficiency (speed-up / N) last.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/scaling.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time

from benchmarks.common import run_info, write_json
from benchmarks.common import table as table_text


class RunFailed(Exception):
    """A run that did not finish: reported in the table, and the next runs go on."""


def logged(run_dir: Path, steps: int) -> tuple[list[dict], list[dict]]:
    """(every logged step, those after the first quarter) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in rows if r.get("event") == "step" or ("tokens_per_s" in r and "loss" in r)]
    return steps_logged, [r for r in steps_logged if r["step"] > steps // 4]


def run(config: str, nproc: int, strategy: str, steps: int, extra: list[str], root: Path, tag: str) -> dict:
    """One job; strategy `solo` starts `nproc` independent one-GPU jobs at once (one per GPU, no communication)
    and adds their rates: what the machine gives N processes when they do not talk to each other."""
    solo = strategy == "solo"
    env_own = dict(e.split("=", 1) for e in extra if re.match(r"[A-Z_][A-Z0-9_]*=", e))
    extra = [e for e in extra if e.split("=", 1)[0] not in env_own]
    dirs = [root / f"{tag}-{k}" for k in range(nproc if solo else 1)]
    cmds = []
    for run_dir in dirs:
        cmd = [sys.executable, "-m", "kiln.cli", "train", config, f"train.run_dir={run_dir}",
               f"train.max_steps={steps}", "train.eval_every=0", "train.sample_tokens=0", "logging.every=5",
               "checkpoint.every=100000", "checkpoint.save_final=false",
               f"dist.strategy={'auto' if solo else strategy}", *extra]
        cmds.append(cmd + (["--nproc", str(nproc)] if nproc > 1 and not solo else []))
    env = [dict(os.environ, **env_own, **({"CUDA_VISIBLE_DEVICES": str(k)} if solo else {}))
           for k in range(len(cmds))]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
             for c, e in zip(cmds, env)]
    try:
        outs = [p.communicate() for p in procs]
    finally:  # stopped by a signal (stop): the jobs save and stop too, instead of holding the GPUs
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
    wall = time.perf_counter() - t0
    for p, c, (_, err) in zip(procs, cmds, outs):
        if p.returncode != 0:  # the lines naming an error first: a long traceback pushes them out of the tail
            named = [line for line in err.splitlines() if "Error" in line or "error:" in line][:20]
            raise RunFailed(f"{' '.join(c)} failed ({p.returncode}):\n" + "\n".join(named) + f"\n...\n{err[-3000:]}")
    runs = [logged(d, steps) for d in dirs]
    tps = sum(statistics.median(r["tokens_per_s"] for r in late) for _, late in runs)
    return {"nproc": nproc, "strategy": strategy, "extra": [f"{k}={v}" for k, v in env_own.items()] + extra,
            "tokens_per_s": tps, "run_dir": str(dirs[0]),
            "mfu": statistics.median(r.get("mfu", 0.0) or 0.0 for r in runs[0][1]), "last_loss": runs[0][0][-1]["loss"],
            "wall_s": round(wall, 1), "command": " ".join(cmds[0][2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="gpu-124m")
    ap.add_argument("--runs", default="1:ddp,2:ddp,2:fsdp", help="comma-separated nproc:strategy pairs")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override (repeatable)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--base", type=float, default=None, help="one-GPU tokens/s of an earlier call on the same "
                    "machine, for the speed-ups of runs without a 1:STRATEGY run of their own")
    ap.add_argument("--profile", type=int, default=0, help="record steps S..S+2 of each run and summarize them")
    ap.add_argument("--repeat", type=int, default=1, help="run the list this many times, in rounds (A B A B: the "
                    "machine's drift falls on every run alike); the table gives each run's median")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a time limit: `run` stops its job
    import torch

    info = run_info(gpus=torch.cuda.device_count(), config=args.config, steps=args.steps)
    if args.profile:
        args.set += [f"profile.start={args.profile}", "profile.steps=3"]
    results = []
    specs = args.runs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for k, spec in [(k, spec) for _ in range(args.repeat) for k, spec in enumerate(specs)]:
            n, strategy, *own = spec.split(":")  # own: KEY=VALUE overrides of this run alone, ';'-separated
            extra = args.set + (own[0].split(";") if own else [])
            tag = f"{len(results)}-{n}-{strategy}"
            try:
                results.append({"spec": k, **run(args.config, int(n), strategy, args.steps, extra, Path(tmp), tag)})
            except RunFailed as e:
                print(e, file=sys.stderr, flush=True)
                results.append({"spec": k, "nproc": int(n), "strategy": strategy, "extra": extra,
                                "error": str(e)[-6000:]})
                continue
            print(json.dumps(results[-1]), flush=True)
            if args.profile:  # printed as each run ends: a call cut by its time limit keeps what it measured
                profile(results[0], results[-1])
    print(json.dumps(info))
    rows = table(results, len(specs), args.base, args.set)
    write_json(args.json, {**info, "results": results, "table": rows})
    failed = [r for r in results if "error" in r]
    if failed:
        sys.exit(f"{len(failed)} of {len(results)} runs failed")


def table(results: list[dict], n_specs: int, base: float | None, common: list[str]) -> list[dict]:
    """Print one row per run of the list: the median tokens/s of its rounds, its speed-up over the first one-GPU
    run's median (else `base`) and its scaling; returns the rows."""
    rows = []
    for k in range(n_specs):
        runs = [r for r in results if r["spec"] == k]
        ok = [r for r in runs if "error" not in r]
        if not runs:
            continue  # not reached: the call's time limit
        row = {key: runs[0][key] for key in ("nproc", "strategy", "extra")}
        row["own"] = " ".join(e for e in row["extra"] if e not in common)
        row["rounds"] = [round(r["tokens_per_s"]) for r in ok]
        row["failed"] = len(runs) - len(ok)
        if ok:
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
            row["mfu"] = statistics.median(r["mfu"] for r in ok)
            row["last_loss"] = ok[-1]["last_loss"]
        rows.append(row)
    base = next((r["tokens_per_s"] for r in rows if r["nproc"] == 1 and "tokens_per_s" in r), base)
    for r in rows:
        up = r["tokens_per_s"] / base if base and "tokens_per_s" in r else None
        r["speedup"], r["scaling"] = up, up and up / r["nproc"]
    print(table_text(rows, [
        ("run", lambda r: f"{r['nproc']} x {r['strategy']}"),
        ("tokens/s", lambda r: r.get("tokens_per_s", "failed"), ",.0f"), ("MFU", "mfu", ".1%"),
        ("speed-up", "speedup", "{:.2f}x"), ("scaling", "scaling", ".1%"), ("loss", "last_loss", ".3f"),
        ("overrides", lambda r: r["own"] + (f"  rounds: {', '.join(f'{t:,}' for t in r['rounds'])}"
                                            if len(r["rounds"]) > 1 else "")
         + (f"  ({r['failed']} failed)" if r["failed"] else ""))]))
    return rows


def profile(first: dict, r: dict) -> None:
    """Summary of run `r`'s trace (rank 0) beside the first run's (benchmarks.trace_summary)."""
    from benchmarks.trace_summary import report, summarize

    traces = [next(iter(sorted(Path(x["run_dir"]).glob("profile/*.trace.json"))), None) if "run_dir" in x else None
              for x in (first, r)]
    if None in traces:
        print(f"no trace for {r['nproc']} x {r['strategy']} {' '.join(r['extra'])}")
        return
    print(f"\n### {r['nproc']} x {r['strategy']} {' '.join(r['extra'])} (beside the first run)")
    try:
        r["profile"] = report([summarize(str(t)) for t in traces])
    except SystemExit as e:  # a trace without GPU kernels (a CPU run)
        r["profile"] = str(e)
    print(r["profile"], flush=True)


if __name__ == "__main__":
    main()
