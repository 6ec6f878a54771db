"""Cost of document masking: a training step with doc_ids beside the same step with plain causal attention.

    python -m benchmarks.doc_mask                      # GPU: 124m, T=2048, B=8, bf16
    python -m benchmarks.doc_mask --size tiny --seq-len 256 --batch-size 8   # CPU

On CUDA the mask is a flex-attention block mask (blocks across documents are skipped); on CPU an
SDPA boolean mask. Rows hold documents of web-like lengths (log-normal, median ~600 tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from kiln.config import ModelConfig
from kiln.model.llama import Transformer


def doc_ids(B: int, T: int, median: float, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        pos, d = 0, 0
        while pos < T:
            n = max(1, int(rng.lognormal(np.log(median), 1.0)))
            out[b, pos:pos + n] = d
            pos, d = pos + n, d + 1
    return torch.from_numpy(out)


def step_time(model, x, y, ids, steps: int, device) -> float:
    cuda = device.type == "cuda"
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    for i in range(steps + 3):
        if i == 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        with ctx:
            loss = model(x, y, ids)
        loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="124m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--median-doc", type=float, default=600)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = ModelConfig(size=args.size, vocab_size=32000, max_seq_len=max(args.seq_len, 512))
    model = Transformer(cfg).to(device)
    B, T = args.batch_size, args.seq_len
    x = torch.randint(0, 32000, (B, T), device=device)
    y = x.roll(-1, 1)
    ids = doc_ids(B, T, args.median_doc).to(device)
    causal = step_time(model, x, y, None, args.steps, device)
    masked = step_time(model, x, y, ids, args.steps, device)
    causal2 = step_time(model, x, y, None, args.steps, device)  # again: drift check
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    docs = float((ids[:, -1] + 1).float().mean())
    print(f"{name}, torch {torch.__version__}, {args.size}, B={B}, T={T}, {docs:.1f} documents per row")
    print(f"  causal (no mask)   {causal * 1e3:8.1f} ms/step  (again: {causal2 * 1e3:.1f})")
    print(f"  document mask      {masked * 1e3:8.1f} ms/step")
    print(f"  ratio masked / causal: {masked / min(causal, causal2):.3f}")
    print(json.dumps({"device": name, "torch": torch.__version__, "size": args.size, "B": B, "T": T,
                      "docs_per_row": docs, "causal_ms": min(causal, causal2) * 1e3, "masked_ms": masked * 1e3,
                      "command": " ".join(["python", *sys.argv])}))


if __name__ == "__main__":
    main()
