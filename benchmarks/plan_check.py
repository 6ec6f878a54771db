"""`kiln plan` against real runs: predicted peak memory and tokens/s beside what `kiln train` measures.

    python benchmarks/plan_check.py --presets gpu-124m,gpu-1b,gpu-3b --steps 30 --out benchmarks/results/plan.md
    python benchmarks/plan_check.py --presets "gpu-1b:train.batch_size=4,gpu-124m:train.compile_scope=blocks"

For each preset it asks the planner (kiln.plan.make_plan, for this machine's GPU), then trains the preset for
`--steps` steps in this process through `kiln.train.run.run` (the preset's data, compile and AC as configured;
no evaluation, no checkpoint), reading torch.cuda.max_memory_allocated and max_memory_reserved at the end
of training (the meter resets them when training starts) and the median logged tokens/s after the first
third of the steps (compilation excluded). It prints a table with the errors (goal: peak within 10%,
tokens/s within 15%) and appends it, with the card and the date, to --out.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/plan_check.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gc
import json
import statistics
import tempfile
import time

from benchmarks.common import run_info, table, write_json


class _Done(Exception):
    """Raised at the end of training to skip the final checkpoint and model save (not measured here)."""


def measure(preset: str, steps: int, extra: list[str], root: Path) -> dict:
    import torch

    from kiln.config import load_config
    from kiln.events import Callback
    from kiln.plan import make_plan
    from kiln.plan.gpus import local_device
    from kiln.train.run import run

    overrides = [f"train.run_dir={root / preset}", f"train.max_steps={steps}", "train.eval_every=0",
                 "train.sample_tokens=0", "logging.every=5", "checkpoint.every=0", "checkpoint.on_signal=false",
                 "checkpoint.save_final=false", *extra]
    cfg = load_config(preset, overrides)
    gpu, _ = local_device(None, cfg.train.device)
    plan = make_plan(cfg, 1, gpu)
    seen: dict = {"tps": [], "step_peaks": []}
    cuda = torch.cuda.is_available()  # on the CPU (a check of the script) no memory is measured

    class Probe(Callback):
        def on_step_end(self, trainer, metrics):
            if metrics and trainer.step > steps // 3:
                seen["tps"].append(metrics["tokens_per_s"])
            if metrics and trainer.step > 3 and "peak_mem_gib" in metrics:  # the meter's read resets the peak
                seen["logged"] = max(seen.get("logged", 0), int(metrics["peak_mem_gib"] * 2**30))
            if trainer.step <= 3 and cuda:  # the first steps apart (compilation, the optimizer's state appearing)
                seen["step_peaks"].append(round(torch.cuda.max_memory_allocated() / 2**30, 2))
                seen["first_peak"] = max(seen.get("first_peak", 0), torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer, metrics):
            if cuda:
                # steps 4 to the end: the peaks of the logged intervals (each read resets it) and of the last one
                seen["steady"] = max(torch.cuda.max_memory_allocated(), seen.get("logged", 0))
                seen["allocated"] = max(seen["steady"], seen.get("first_peak", 0))
                seen["reserved"] = torch.cuda.max_memory_reserved()
            raise _Done

    t0 = time.perf_counter()
    try:
        run(cfg, callbacks=[Probe()])
    except _Done:
        pass
    wall = time.perf_counter() - t0
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tps = statistics.median(seen["tps"])
    gib = {k: seen[k] / 2**30 if k in seen else None for k in ("allocated", "reserved", "steady")}
    return {"preset": preset, "batch": cfg.train.batch_size, "ac": cfg.train.activation_checkpointing,
            "predicted_gib": plan.memory.peak / 2**30, "allocated_gib": gib["allocated"],
            "reserved_gib": gib["reserved"], "predicted_tps": plan.tokens_per_s, "tps": tps,
            "mem_error": plan.memory.peak / seen["allocated"] - 1 if "allocated" in seen else None,
            "tps_error": plan.tokens_per_s / tps - 1 if plan.tokens_per_s else None, "max_batch": plan.max_batch,
            "wall_s": round(wall, 1), "first_step_peaks_gib": seen["step_peaks"], "steady_gib": gib["steady"]}


COLUMNS = [("preset", "preset"), ("batch", "batch"), ("AC", "ac"), ("peak predicted GiB", "predicted_gib", ".1f"),
           ("allocated GiB", "allocated_gib", ".1f"), ("reserved GiB", "reserved_gib", ".1f"),
           ("error", "mem_error", "+.1%"), ("tokens/s predicted", "predicted_tps", ",.0f"),
           ("tokens/s measured", "tps", ",.0f"), ("error", "tps_error", "+.1%"), ("plan's largest batch", "max_batch")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="gpu-124m,gpu-1b,gpu-3b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override for every run")
    ap.add_argument("--out", default=None, help="markdown file to append the results to")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = run_info()
    card, date = info["device"], info["date"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, spec in enumerate(args.presets.split(",")):
            preset, *own = spec.split(":")  # own: KEY=VALUE overrides of this run alone, ';'-separated
            extra = args.set + (own[0].split(";") if own else [])
            rows.append(measure(preset, args.steps, extra, Path(tmp) / str(k)))
            rows[-1]["preset"] = spec
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows, COLUMNS, markdown=True)
    ok = all(abs(r["mem_error"] if r["mem_error"] is not None else 1) <= 0.10
             and abs(r["tps_error"] if r["tps_error"] is not None else 1) <= 0.15 for r in rows)
    print(text)
    print("goal (peak within 10%, tokens/s within 15%):", "met" if ok else "NOT met")
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## {card}, {date}\n\n- Command: `python benchmarks/plan_check.py --presets {args.presets} "
                    f"--steps {args.steps}" + "".join(f" --set {s}" for s in args.set) + f"`\n- torch "
                    f"{info['torch']}; `kiln train` of each preset in one process; peak = "
                    "torch.cuda.max_memory_allocated over the training steps; tokens/s = median logged after the "
                    f"first third of the steps\n- goal met: {'yes' if ok else 'no'}\n\n{text}\n")
    write_json(args.json, {**info, "card": card, "rows": rows})


if __name__ == "__main__":
    main()
