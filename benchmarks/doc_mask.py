"""Cost of document masking: a training step with doc_ids beside the same step with plain causal attention.

    python -m benchmarks.doc_mask                      # GPU: 124m, T=2048, B=8, bf16
    python -m benchmarks.doc_mask --size tiny --seq-len 256 --batch-size 8   # CPU

On CUDA the mask is a flex-attention block mask (blocks across documents are skipped); on CPU an
SDPA boolean mask. Rows hold documents of web-like lengths (log-normal, median ~600 tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/doc_mask.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import json

import torch

from benchmarks.common import device_name, run_info, seconds_per_call
from benchmarks.synthetic import doc_ids
from kiln.config import ModelConfig
from kiln.model.llama import Transformer


def step_time(model, x, y, ids, steps: int, device) -> float:
    """Seconds of a forward and backward pass (bf16 autocast on CUDA), after 3 untimed ones."""
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext

    def step():
        with ctx():
            loss = model(x, y, ids)
        loss.backward()

    return seconds_per_call(step, steps, warmup=3, dev=device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="124m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--median-doc", type=float, default=600)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = ModelConfig(size=args.size, vocab_size=args.vocab, max_seq_len=max(args.seq_len, 512))
    model = Transformer(cfg).to(device)
    B, T = args.batch_size, args.seq_len
    x = torch.randint(0, args.vocab, (B, T), device=device)
    y = x.roll(-1, 1)
    ids = doc_ids(B, T, args.median_doc).to(device)
    causal = step_time(model, x, y, None, args.steps, device)
    masked = step_time(model, x, y, ids, args.steps, device)
    causal2 = step_time(model, x, y, None, args.steps, device)  # again: drift check
    name = device_name(device)
    docs = float((ids[:, -1] + 1).float().mean())
    print(f"{name}, torch {torch.__version__}, {args.size}, B={B}, T={T}, {docs:.1f} documents per row")
    print(f"  causal (no mask)   {causal * 1e3:8.1f} ms/step  (again: {causal2 * 1e3:.1f})")
    print(f"  document mask      {masked * 1e3:8.1f} ms/step")
    print(f"  ratio masked / causal: {masked / min(causal, causal2):.3f}")
    print(json.dumps(run_info(device, size=args.size, B=B, T=T, docs_per_row=docs,
                               causal_ms=min(causal, causal2) * 1e3, masked_ms=masked * 1e3)))


if __name__ == "__main__":
    main()
