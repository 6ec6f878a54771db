"""End-to-end tokenization of the Python standard library source: Kiln against Hugging Face datasets.

Both sides read the same files (one document per file), use the same tokenizer.json and the
same number of processes, append EOS to every document and write the token ids to disk:

  kiln       kiln.data.prepare.pipeline.prepare: read, validate, tokenize in N worker processes, write
             uint16 shards + document index + manifest with sha256 (dedup and val split off, so
             the outputs can be compared token for token).
  hf         datasets.load_dataset("text", sample_by="document") -> .map(batched=True, num_proc=N)
             with transformers' PreTrainedTokenizerFast (the usual recipe) -> token ids written to
             a flat uint16 file as in nanoGPT's prepare.py.
  hf-fast    the same, but the map function calls tokenizers' encode_batch_fast directly (the
             strongest form of the baseline: no offsets, no transformers wrapper).

Each side starts from a fresh cache directory; imports are done before timing; the input files
are read once beforehand so both find them in the page cache. The token streams are checked
equal. Prints seconds per side and the ratios.

    python benchmarks/tokenize_speed.py --workers 2      # or: python -m benchmarks.tokenize_speed
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/tokenize_speed.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import shutil
import tempfile
import time

from benchmarks.common import run_info, write_json

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core on both sides


def corpus(root: str | None = None) -> list[str]:
    """The stdlib .py files that are non-empty valid UTF-8 without CR bytes or a byte order mark
    (datasets reads text with universal newlines and keeps a BOM; Kiln keeps CRs and drops a BOM:
    without either, both sides see exactly the same text)."""
    from kiln.data.read.sources import stdlib_files

    out = []
    for p in stdlib_files() if root is None else sorted(Path(root).rglob("*.py")):
        raw = p.read_bytes()
        try:
            if raw.decode("utf-8").strip() and b"\r" not in raw and not raw.startswith(b"\xef\xbb\xbf"):
                out.append(str(p))
        except UnicodeDecodeError:
            pass
    return out


def run_kiln(files: list[str], tok_path: str, workers: int, work: Path):
    import numpy as np

    from kiln.config import DataConfig
    from kiln.data.prepare.pipeline import prepare

    cfg = DataConfig(sources=files, format="text", max_bytes=None, tokenizer=tok_path, workers=workers,
                     val_fraction=0.0, dedup=False, cache_dir=str(work / "kiln"))
    t0 = time.perf_counter()
    ds = prepare(cfg)
    dt = time.perf_counter() - t0
    tokens = np.concatenate([np.fromfile(b, ds.dtype) for b, _, _ in ds.shards("train")])
    return dt, tokens


def run_hf(files: list[str], tok_path: str, workers: int, work: Path, fast: bool):
    import datasets
    import numpy as np

    datasets.disable_progress_bars()
    if fast:
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(tok_path)
        eos = tk.token_to_id("<|endoftext|>")

        def encode(batch):
            ids = [e.ids + [eos] for e in tk.encode_batch_fast(batch["text"], add_special_tokens=False)]
            return {"ids": ids, "len": [len(x) for x in ids]}
    else:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=tok_path)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")

        def encode(batch):
            ids = [x + [eos] for x in tok(batch["text"], add_special_tokens=False)["input_ids"]]
            return {"ids": ids, "len": [len(x) for x in ids]}

    cache = work / ("hf-fast" if fast else "hf")
    t0 = time.perf_counter()
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                               cache_dir=str(cache))
    ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"])
    n = int(np.sum(ds["len"], dtype=np.uint64))
    out = np.memmap(cache / "train.bin", dtype=np.uint16, mode="w+", shape=(n,))
    pos, shards = 0, min(64, len(ds))
    for i in range(shards):  # nanoGPT's write loop
        part = ds.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        arr = np.concatenate(part["ids"])
        out[pos:pos + len(arr)] = arr
        pos += len(arr)
    out.flush()
    dt = time.perf_counter() - t0
    return dt, np.asarray(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="processes on each side (N); default: the cores this process may run on")
    ap.add_argument("--vocab", type=int, default=32000, help="size of the BPE both sides use")
    ap.add_argument("--repeat", type=int, default=1, help="runs per side; the best is kept")
    ap.add_argument("--out", help="write the result as JSON here too")
    ap.add_argument("--corpus", help="a directory of .py files to use instead of this Python's standard library")
    args = ap.parse_args()

    import numpy as np

    from kiln.data.prepare.tokenizer import train_bpe

    files = corpus(args.corpus)
    size = sum(os.path.getsize(f) for f in files)
    for f in files:  # page cache warm for both sides
        Path(f).read_bytes()
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-tok-"))
    tok_path = str(work / "tokenizer.json")
    train_bpe((Path(f).read_text() for f in files[::4]), args.vocab).save(tok_path)
    print(f"corpus: {len(files)} stdlib files, {size / 1e6:.1f} MB; BPE vocab {args.vocab}; N = {args.workers}")

    best: dict[str, float] = {}
    outputs = {}
    for r in range(args.repeat):
        for name in ("hf", "hf-fast", "kiln"):
            sub = work / f"run{r}"
            sub.mkdir(exist_ok=True)
            if name == "kiln":
                dt, toks = run_kiln(files, tok_path, args.workers, sub)
            else:
                dt, toks = run_hf(files, tok_path, args.workers, sub, fast=name == "hf-fast")
            outputs[name] = toks
            best[name] = min(best.get(name, float("inf")), dt)
            print(f"  run {r + 1} {name:8s} {dt:7.2f} s  {len(toks) / dt / 1e6:5.2f} M tokens/s")
            shutil.rmtree(sub / name, ignore_errors=True)
    same = all(np.array_equal(outputs["kiln"], outputs[k]) for k in ("hf", "hf-fast"))
    print(f"token streams identical: {same} ({len(outputs['kiln']):,} tokens)")
    ratio, ratio_fast = best["hf"] / best["kiln"], best["hf-fast"] / best["kiln"]
    print(f"kiln {best['kiln']:.2f} s | hf datasets + transformers {best['hf']:.2f} s -> {ratio:.2f}x | "
          f"hf datasets + tokenizers fast {best['hf-fast']:.2f} s -> {ratio_fast:.2f}x")
    import torch

    result = run_info(torch.device("cpu"), ["datasets", "transformers", "tokenizers"],
                      cores_allowed=len(os.sched_getaffinity(0)), workers=args.workers, corpus_files=len(files),
                      corpus_bytes=size, tokens=len(outputs["kiln"]), identical_tokens=bool(same),
                      seconds={k: round(v, 2) for k, v in best.items()}, speedup_vs_hf=round(ratio, 2),
                      speedup_vs_hf_fast=round(ratio_fast, 2))
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    shutil.rmtree(work, ignore_errors=True)
    if not same:
        sys.exit("token streams differ: the comparison is not like for like")


if __name__ == "__main__":
    main()
