"""Attention kernels for packed rows, forward + backward: causal SDPA beside the document-masked kernels.

    python -m benchmarks.attention                 # 124m and 1b shapes, T=2048, bf16, on CUDA

Document masking keeps attention inside each document of a packed row. This times one attention
call (forward and backward) of a layer's shape for: plain causal SDPA (PyTorch's pick, cuDNN on
Hopper, and forced flash), flex attention with a document block mask (PyTorch's default tiles and
the tiles Kiln uses on Hopper), variable-length flash attention (`torch.nn.attention.varlen`) and
cuDNN's ragged kernel over the same documents, and checks that the masked kernels agree.
Documents have log-normal lengths with the given medians (1,759 tokens is the
median of the Python-source corpus of benchmarks/real_run.py; 600 is web-like text).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/attention.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.common import run_info, seconds_per_call, table, write_json
from benchmarks.synthetic import doc_ids as make_doc_ids

CUDA_ONLY = "cuda only"  # a kernel PyTorch has for CUDA alone, in a CPU run (a check of the script itself)


def run(B: int, H: int, KV: int, T: int, hd: int, median: float, iters: int, dev: torch.device) -> dict:
    """Milliseconds of one attention call, forward and backward, of each kernel (bf16 on CUDA; on the CPU, in
    fp32, the kernels the CPU has, flex attention uncompiled and forward only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, hd, device=dev, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(B, T, KV, hd, device=dev, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(B, T, KV, hd, device=dev, dtype=dtype, generator=g, requires_grad=True)
    dy = torch.randn(B, T, H, hd, device=dev, dtype=dtype, generator=g)
    ids_cpu = make_doc_ids(B, T, median)
    ids = ids_cpu.to(dev)
    gqa = KV != H
    out: dict = {"B": B, "H": H, "KV": KV, "T": T, "hd": hd, "median_doc": median,
                 "docs_per_row": float((ids_cpu[:, -1] + 1).float().mean())}

    def ms(fn) -> float:
        return seconds_per_call(fn, iters, warmup=3, dev=dev) * 1e3

    def sdpa():
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=gqa)
        y.transpose(1, 2).backward(dy)

    out["sdpa_default_ms"] = ms(sdpa)
    out["sdpa_flash_ms"] = out["sdpa_cudnn_ms"] = CUDA_ONLY
    if cuda:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out["sdpa_flash_ms"] = ms(sdpa)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out["sdpa_cudnn_ms"] = ms(sdpa)

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & (ids[b, qi] == ids[b, ki])

    bm = create_block_mask(mask_mod, B, None, T, T, device=dev)
    flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    results = {}

    def run_flex(opts=None):
        def f():
            qkv = (t.transpose(1, 2) if cuda else t.detach().transpose(1, 2) for t in (q, k, v))
            y = flex(*qkv, block_mask=bm, enable_gqa=gqa, kernel_options=opts)
            if cuda:  # PyTorch's flex attention has no backward on the CPU
                y.transpose(1, 2).backward(dy)
            results["flex"] = y.detach().transpose(1, 2)
        return f

    out["flex_ms"] = ms(run_flex())
    from kiln.model.masks import HOPPER_HD64_TILES

    out["flex_tiles_ms"] = ms(run_flex(HOPPER_HD64_TILES)) if cuda else CUDA_ONLY  # the tiles Kiln uses on Hopper
    seg = cu_seqlens(ids_cpu).to(dev)
    out["segments"] = int(seg.numel() - 1)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        out["varlen_ms"] = "unavailable"
        return out
    if not cuda:
        out["varlen_ms"] = out["cudnn_ragged_ms"] = CUDA_ONLY
        return out

    def varlen(cu=seg, keep=True):  # torch 2.11's varlen_attn takes GQA inputs as they are
        y = varlen_attn(q.reshape(B * T, H, hd), k.reshape(B * T, KV, hd), v.reshape(B * T, KV, hd),
                        cu, cu, T, T, window_size=(-1, 0))
        y.backward(dy.reshape(B * T, H, hd))
        if keep:
            results["varlen"] = y.detach().view(B, T, H, hd)

    out["varlen_ms"] = ms(varlen)
    out["cudnn_ragged_ms"] = _cudnn_ragged(q, k, v, dy, seg, results, ms)
    if "cudnn_ragged" in results:
        diff = results["cudnn_ragged"].float() - results["flex"].float()
        out["max_abs_diff_cudnn_ragged_flex"] = float(diff.abs().max())
    out["max_abs_diff_varlen_flex"] = float((results["varlen"].float() - results["flex"].float()).abs().max())
    return out


def cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document index per position -> int32 starts of every (row, document) piece, then B*T."""
    B, T = doc_ids.shape
    start = torch.ones(B, T, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.cat([start.flatten().nonzero().squeeze(1), torch.tensor([B * T])]).int()


def _cudnn_ragged(q, k, v, dy, cu, results, ms):
    """cuDNN's attention over variable-length pieces (the kernel PyTorch uses for jagged nested tensors)."""
    B, T, H, hd = q.shape
    rep = H // k.shape[2]

    def f():
        kk, vv = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k, v))
        y = torch.ops.aten._cudnn_attention_forward(
            q.reshape(B * T, H, hd), kk.reshape(B * T, H, hd), vv.reshape(B * T, H, hd), None, cu, cu,
            T, T, True, 0.0, True, False)[0]
        y.backward(dy.reshape(B * T, H, hd))
        results["cudnn_ragged"] = y.detach().view(B, T, H, hd)

    try:
        return ms(f)
    except Exception as e:  # noqa: BLE001 (reported in the table)
        return f"failed: {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="16x12/12,8x32/4",
                    help="comma-separated BxH/KV: rows, query heads and key/value heads (head size 64)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--medians", default="1759,600", help="comma-separated median document lengths")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels the CPU has (a check of the script)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = []
    for shape in args.shapes.split(","):
        b, heads = shape.split("x")
        h, kv = heads.split("/")
        for median in args.medians.split(","):
            rows.append(run(int(b), int(h), int(kv), args.seq, 64, float(median), args.iters, dev))
            print(json.dumps(rows[-1]), flush=True)
    env = run_info(dev)
    print(env)
    keys = ["sdpa_cudnn_ms", "sdpa_flash_ms", "flex_ms", "flex_tiles_ms", "varlen_ms", "cudnn_ragged_ms"]
    print(table(rows, [("B", "B"), ("H/KV", lambda r: f"{r['H']}/{r['KV']}"), ("median", "median_doc", ".0f"),
                       ("docs", "docs_per_row", ".1f"), *((k[:-3], k, ".3f") for k in keys)]))
    write_json(args.json, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
