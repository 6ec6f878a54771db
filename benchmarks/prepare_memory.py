"""Peak memory of `kiln prepare` on a multi-GB JSON Lines (or JSON array) file against a file 16x smaller.

Streaming readers, bounded in-flight batches and shard-at-a-time writing should make the peak
resident memory of the whole process tree (the prepare process and its tokenizer workers) the
same for both files: bounded by batch size, not by file size.

    python benchmarks/prepare_memory.py --gb 2 --workers 2
    python benchmarks/prepare_memory.py --gb 2 --workers 2 --format json   # one JSON array of records

Writes the input files under --dir (default /tmp/kiln-bench-mem) if missing: Python standard
library source files as JSON records, each record made unique, so deduplication keeps them all.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/prepare_memory.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shutil
import subprocess
import time

from benchmarks.common import run_info

CHILD = """
import sys, json
from kiln.config import DataConfig
from kiln.data.prepare.pipeline import prepare
cfg = DataConfig(**json.loads(sys.argv[1]))
ds = prepare(cfg)
print(json.dumps(ds.manifest["report"]))
"""


def make_input(path: Path, size: int) -> None:
    """JSON records of stdlib source, one per line (.jsonl) or as the items of one array (.json)."""
    if path.is_file() and path.stat().st_size >= size:
        return
    from kiln.data.read.sources import stdlib_files

    texts = [p.read_text(errors="replace") for p in stdlib_files()]
    array = path.suffix == ".json"
    tmp = path.with_suffix(".tmp")
    written, i = 0, 0
    with open(tmp, "w") as f:
        f.write("[\n" if array else "")
        while written < size:
            line = ("," if array and i else "") + json.dumps({"text": f"# copy {i}\n" + texts[i % len(texts)]}) + "\n"
            f.write(line)
            written += len(line)
            i += 1
        f.write("]\n" if array else "")
    tmp.replace(path)


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run(path: Path, cache: Path, workers: int) -> dict:
    cfg = {"sources": [str(path)], "format": path.suffix[1:], "max_bytes": None, "cache_dir": str(cache),
           "workers": workers, "tokenizer": str(cache / "tokenizer.json")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.2)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"prepare failed on {path}")
    report = json.loads(out.strip().splitlines()[-1])
    return {"file": str(path), "file_bytes": path.stat().st_size, "peak_rss_bytes": peak,
            "seconds": round(time.perf_counter() - t0, 1), "tokens": report["tokens"],
            "documents": report["documents"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the large input file")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--dir", default="/tmp/kiln-bench-mem")
    ap.add_argument("--format", choices=["jsonl", "json"], default="jsonl")
    ap.add_argument("--vocab", type=int, default=32000, help="size of the BPE trained for both runs")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    big, small = d / f"big.{args.format}", d / f"small.{args.format}"
    make_input(big, int(args.gb * 1e9))
    make_input(small, int(args.gb * 1e9 / 16))
    cache = d / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.data.read.sources import stdlib_files

    train_bpe((p.read_text(errors="replace") for p in stdlib_files()[:400]), args.vocab).save(cache / "tokenizer.json")
    results = [run(small, cache, args.workers), run(big, cache, args.workers)]
    for r in results:
        print(f"{r['file_bytes'] / 1e9:6.2f} GB input: peak RSS {r['peak_rss_bytes'] / 2**20:7.1f} MiB "
              f"(process tree), {r['seconds']} s, {r['tokens']:,} tokens")
    ratio = results[1]["peak_rss_bytes"] / results[0]["peak_rss_bytes"]
    print(f"input size ratio {results[1]['file_bytes'] / results[0]['file_bytes']:.1f}x, "
          f"peak RSS ratio {ratio:.2f}x")
    print(json.dumps(run_info(None, workers=args.workers, format=args.format, runs=results,
                              rss_ratio=round(ratio, 3)), indent=1))


if __name__ == "__main__":
    main()
