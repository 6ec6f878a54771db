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

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

if __package__:  # python -m benchmarks.attention
    from benchmarks.doc_mask import doc_ids as make_doc_ids
else:  # python benchmarks/attention.py: this folder is first on sys.path
    from doc_mask import doc_ids as make_doc_ids


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def run(B: int, H: int, KV: int, T: int, hd: int, median: float, iters: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, hd, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(B, T, KV, hd, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(B, T, KV, hd, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    dy = torch.randn(B, T, H, hd, device=dev, dtype=torch.bfloat16, generator=g)
    ids_cpu = make_doc_ids(B, T, median)
    ids = ids_cpu.to(dev)
    gqa = KV != H
    out: dict = {"B": B, "H": H, "KV": KV, "T": T, "hd": hd, "median_doc": median,
                 "docs_per_row": float((ids_cpu[:, -1] + 1).float().mean())}

    def sdpa():
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=gqa)
        y.transpose(1, 2).backward(dy)

    out["sdpa_default_ms"] = _time(sdpa, iters)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out["sdpa_flash_ms"] = _time(sdpa, iters)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out["sdpa_cudnn_ms"] = _time(sdpa, iters)

    def mask_mod(b, h, qi, ki):
        return (qi >= ki) & (ids[b, qi] == ids[b, ki])

    bm = create_block_mask(mask_mod, B, None, T, T, device=dev)
    flex = torch.compile(flex_attention, dynamic=False)
    results = {}

    def run_flex(opts=None):
        def f():
            y = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=gqa,
                     kernel_options=opts)
            y.transpose(1, 2).backward(dy)
            results["flex"] = y.detach().transpose(1, 2)
        return f

    out["flex_ms"] = _time(run_flex(), iters)
    from kiln.model.masks import HOPPER_HD64_TILES

    out["flex_tiles_ms"] = _time(run_flex(HOPPER_HD64_TILES), iters)  # the tiles Kiln uses on Hopper
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        out["varlen_ms"] = "unavailable"
        return out
    seg = cu_seqlens(ids_cpu).to(dev)
    out["segments"] = int(seg.numel() - 1)

    def varlen(cu=seg, keep=True):  # torch 2.11's varlen_attn takes GQA inputs as they are
        y = varlen_attn(q.reshape(B * T, H, hd), k.reshape(B * T, KV, hd), v.reshape(B * T, KV, hd),
                        cu, cu, T, T, window_size=(-1, 0))
        y.backward(dy.reshape(B * T, H, hd))
        if keep:
            results["varlen"] = y.detach().view(B, T, H, hd)

    out["varlen_ms"] = _time(varlen, iters)
    out["cudnn_ragged_ms"] = _cudnn_ragged(q, k, v, dy, seg, results, iters)
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


def _cudnn_ragged(q, k, v, dy, cu, results, iters):
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
        return _time(f, iters)
    except Exception as e:  # noqa: BLE001 (reported in the table)
        return f"failed: {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    rows = []
    for shape in ((16, 12, 12, 2048, 64), (8, 32, 4, 2048, 64)):
        for median in (1759, 600):
            rows.append(run(*shape, median, args.iters))
            print(json.dumps(rows[-1]), flush=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    print(env)
    keys = ["sdpa_cudnn_ms", "sdpa_flash_ms", "flex_ms", "flex_tiles_ms", "varlen_ms", "cudnn_ragged_ms"]
    print(f"{'B H/KV':>9} {'median':>6} {'docs':>5} " + " ".join(f"{k[:-3]:>14}" for k in keys))
    for r in rows:
        cells = " ".join(f"{r[k]:>14.3f}" if isinstance(r.get(k), float) else f"{r.get(k)!s:>14}" for k in keys)
        print(f"{r['B']:>3} {r['H']:>2}/{r['KV']:<2} {r['median_doc']:>6} {r['docs_per_row']:>5.1f} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
