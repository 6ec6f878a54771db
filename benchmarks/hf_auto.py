"""Training speed of the native model against the `model.hf_class=auto` path, same Llama shape, one process.

    python benchmarks/hf_auto.py                                   # CPU, tiny, a few steps
    python benchmarks/hf_auto.py --size 124m --device cuda --batch 16 --seq 1024 --compile

Builds Kiln's `Transformer` of `--size` and `transformers.LlamaForCausalLM` of the same shape with the
same weights (the native model's, mapped by kiln.model.hf), wraps the latter in
`kiln.model.hf_auto.HFCausalLM` (what `model.hf_class=auto` trains), and trains each on the same random
packed rows (documents of random length, document masking on unless --no-doc-mask): AdamW (fused on
CUDA), bf16 autocast on CUDA, `kiln.parallel` activation checkpointing and per-block compile as asked. Each
model does --warmup steps (compilation included), then --steps timed steps between two device
synchronisations. Prints tokens/s, peak memory and the auto path's speed as a fraction of the native
one's; the first losses agree (same function) as a check. Writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # benchmarks/ has scripts named like standard modules: don't shadow them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def batches(vocab: int, batch: int, seq: int, n: int, doc_mask: bool, device: torch.device, seed: int = 0):
    """`n` (tokens, targets, doc_ids) batches of random tokens in documents of 16..seq tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        docs = None
        if doc_mask:
            starts = torch.rand(batch, seq, generator=g) < 4.0 / seq  # about 4 documents a row
            starts[:, 0] = True
            docs = starts.long().cumsum(1) - 1
        out.append((x[:, :-1].to(device), x[:, 1:].to(device), docs))
    return out


def run(name: str, model: torch.nn.Module, data: list, args, device: torch.device) -> dict:
    from kiln.parallel.ac import apply_ac
    from kiln.parallel.compile import apply_compile

    apply_ac(model, args.ac)
    if args.compile:
        apply_compile(model)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext
    losses = []

    def step(batch):
        x, y, docs = batch
        with autocast():
            loss = model(x, y, docs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup):
        losses.append(step(data[i % len(data)]).item())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync()
    t = time.perf_counter()
    for i in range(args.steps):
        last = step(data[(args.warmup + i) % len(data)])
    sync()
    elapsed = time.perf_counter() - t
    tokens = args.steps * args.batch * args.seq
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"name": name, "tokens_per_s": tokens / elapsed, "peak_gib": peak, "first_loss": losses[0],
            "last_loss": last.item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", help="Kiln model size (tiny, 124m, 350m, 1b, ...).")
    ap.add_argument("--device", default="cpu", help="cpu or cuda.")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="Timed steps.")
    ap.add_argument("--warmup", type=int, default=2, help="Untimed steps first (compilation included).")
    ap.add_argument("--vocab", type=int, default=None, help="Vocabulary (default: the size's, else 512).")
    ap.add_argument("--compile", action="store_true", help="Per-block torch.compile on both (kiln.parallel.compile).")
    ap.add_argument("--ac", default="none", choices=["none", "selective", "full"], help="Activation checkpointing.")
    ap.add_argument("--no-doc-mask", dest="doc_mask", action="store_false", help="One sequence per row.")
    args = ap.parse_args()

    import transformers

    from kiln.config import ModelConfig
    from kiln.model.hf import hf_config, to_hf_state_dict
    from kiln.model.hf_auto import HFCausalLM
    from kiln.model.llama import Transformer

    device = torch.device(args.device)
    cfg = ModelConfig(size=args.size)
    cfg = cfg.model_copy(update={"vocab_size": args.vocab or cfg.vocab_size or 512,
                                 "max_seq_len": max(cfg.max_seq_len, args.seq)})
    data = batches(cfg.vocab_size, args.batch, args.seq, args.warmup + args.steps, args.doc_mask, device)
    torch.manual_seed(0)
    native = Transformer(cfg)
    hf = transformers.LlamaForCausalLM(hf_config(cfg, dtype="float32"))
    hf.load_state_dict(to_hf_state_dict(native.state_dict(), cfg.tie_embeddings), strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    hf.config.use_cache = False
    results = [run("native", native, data, args, device)]
    del native
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results.append(run("auto", HFCausalLM(hf, cfg), data, args, device))

    n = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{args.size} ({n / 1e6:.1f}M parameters), batch {args.batch} x {args.seq} tokens, {name}, "
          f"compile={args.compile}, ac={args.ac}, doc_mask={args.doc_mask}")
    print(f"{'path':8} {'tokens/s':>12} {'peak GiB':>9} {'first loss':>11} {'last loss':>10}")
    for r in results:
        print(f"{r['name']:8} {r['tokens_per_s']:12,.0f} {r['peak_gib']:9.2f} {r['first_loss']:11.4f} "
              f"{r['last_loss']:10.4f}")
    print(f"auto / native: {results[1]['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x the native speed")


if __name__ == "__main__":
    main()
