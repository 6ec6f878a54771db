"""A real run: the gpu-124m preset on this machine's own Python source, whole pipeline on.

    python benchmarks/real_run.py --out runs/real124m [--prepare-only] [--steps 2000]

Prepares the standard library and the installed packages' .py files with `kiln prepare` (Kiln's
own BPE tokenizer, shards, validation split), then trains with `kiln train gpu-124m` exactly as a
user would (loader with document masking, evaluation, async checkpoints, metrics.jsonl), and
summarises metrics.jsonl: training tokens/s (median over logged intervals after warm-up), MFU,
data-wait fraction, wall time, and the validation-loss curve, written to <out>/summary.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/real_run.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import subprocess
import sysconfig
import time

KILN = [sys.executable, "-m", "kiln.cli"]  # the `kiln` command, of the kiln this Python imports


def data_overrides(max_bytes: int, cache: str, vocab: int = 32000) -> list[str]:
    std = sysconfig.get_paths()["stdlib"]
    site = sysconfig.get_paths()["purelib"]
    sources = [f"{std}/**/*.py"]
    if not Path(site).resolve().is_relative_to(Path(std).resolve()):  # a venv's packages live elsewhere
        sources.append(f"{site}/**/*.py")
    return [f"data.sources={json.dumps(sources)}", f"data.max_bytes={max_bytes}", f"data.vocab_size={vocab}",
            "data.tokenizer_train_bytes=50000000", "data.on_bad_record=skip", "data.val_fraction=0.01",
            f"data.cache_dir={cache}"]


def summarise(run_dir: Path, wall_s: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("event") == "train"]
    evals = [{"step": r["step"], "val_loss": r["val_loss"]} for r in rows if r.get("event") == "eval"]
    steady = train[len(train) // 10 + 1:] or train  # leave out the first tenth: compilation, warm-up
    def med(key):
        values = [r[key] for r in steady if key in r]
        return statistics.median(values) if values else None

    return {"steps": train[-1]["step"] if train else 0, "tokens": train[-1]["tokens"] if train else 0,
            "wall_s": wall_s, "tokens_per_s_median": med("tokens_per_s"), "mfu_median": med("mfu"),
            "data_wait_median": med("data_wait"), "peak_mem_gib": max((r.get("peak_mem_gib", 0) for r in train),
                                                                      default=None),
            "first_val_loss": evals[0]["val_loss"] if evals else None,
            "last_val_loss": evals[-1]["val_loss"] if evals else None, "val_curve": evals}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpu-124m", help="the preset (or YAML file) trained")
    p.add_argument("--out", default="runs/real124m", help="run directory")
    p.add_argument("--cache", default=".kiln-cache", help="data.cache_dir (prepared data is reused from here)")
    p.add_argument("--max-bytes", type=int, default=400_000_000, help="characters of source to read")
    p.add_argument("--steps", type=int, default=2000)  # the tokens of the 16-row preset's 4000
    p.add_argument("--vocab", type=int, default=32000, help="size of the BPE trained on the corpus")
    p.add_argument("--prepare-only", action="store_true")
    p.add_argument("extra", nargs="*", help="more KEY=VALUE overrides for kiln train")
    a = p.parse_args()
    data = data_overrides(a.max_bytes, a.cache, a.vocab)
    t = time.perf_counter()
    subprocess.run([*KILN, "prepare", a.config, *data], check=True)
    print(f"prepare: {time.perf_counter() - t:.0f} s", flush=True)
    if a.prepare_only:
        return
    train = [f"train.max_steps={a.steps}", "train.eval_every=250", "train.eval_batches=20", "train.sample_tokens=60",
             f"train.run_dir={a.out}", "checkpoint.every=1000", "checkpoint.keep_last=2", "logging.every=50",
             "logging.console=false", *a.extra]
    t = time.perf_counter()
    subprocess.run([*KILN, "train", a.config, *data, *train], check=True)
    summary = summarise(Path(a.out), time.perf_counter() - t)
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    curve = summary.pop("val_curve")
    print(json.dumps(summary))
    print("val loss:", " ".join(f"{e['step']}:{e['val_loss']:.3f}" for e in curve))


if __name__ == "__main__":
    main()
