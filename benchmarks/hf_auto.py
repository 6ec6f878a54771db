"""Training speed of the native model against the `model.hf_class=auto` path, same Llama shape, one process.

    python benchmarks/hf_auto.py                                   # CPU, tiny, a few steps
    python benchmarks/hf_auto.py --size 124m --device cuda --batch 16 --seq 1024 --compile

Builds Kiln's `Transformer` of `--size` and `transformers.LlamaForCausalLM` of the same shape with the
same weights (the native model's, mapped by kiln.model.hf), wraps the latter in
`kiln.model.hf_auto.HFCausalLM` (what `model.hf_class=auto` trains), and trains each through Kiln's own
`Trainer` and loader on the same random tokens (documents of random length, document masking on unless
--no-doc-mask): Kiln's AdamW (fused on CUDA), bf16 autocast on CUDA, `kiln.parallel` activation
checkpointing and per-block compile as asked. Each
model does --warmup steps (compilation included), then --steps timed steps between two device
synchronisations. Prints tokens/s, peak memory and the auto path's speed as a fraction of the native
one's; the first losses agree (same function) as a check. Writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/hf_auto.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import tempfile

import torch

from benchmarks.common import device_name, free, peak_gib, seconds_per_call, table
from benchmarks.synthetic import random_loader


def run(name: str, model: torch.nn.Module, cfg, args, device: torch.device, data: str) -> dict:
    """`model` trained by Kiln's Trainer on Kiln's loader of random tokens (about 4 documents a row, or one
    without document masking): --warmup steps, then --steps timed."""
    from kiln.parallel.ac import apply_ac
    from kiln.parallel.compile import apply_compile
    from kiln.train.trainer import Trainer

    apply_ac(model, args.ac)
    if args.compile:
        apply_compile(model)
    model.to(device).train()
    loader = random_loader(data, args.batch, args.seq, cfg.model.vocab_size, docs_per_row=4 * args.doc_mask,
                           batches=args.warmup + args.steps)
    trainer = Trainer(cfg, model, loader, None, device)
    losses = [trainer.train_step()[0].item() for _ in range(args.warmup)]
    if device.type == "cuda":  # the peak from here: training, not building (compiled graphs kept)
        torch.cuda.reset_peak_memory_stats(device)
    last = []
    seconds = seconds_per_call(lambda: last.append(trainer.train_step()[0]), args.steps, dev=device)
    loader.close()
    return {"name": name, "tokens_per_s": args.batch * args.seq / seconds, "peak_gib": peak_gib() or None,
            "first_loss": losses[0] if losses else None, "last_loss": last[-1].item()}


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

    from kiln.config import ModelConfig, RunConfig
    from kiln.model.hf import hf_config, to_hf_state_dict
    from kiln.model.hf_auto import HFCausalLM
    from kiln.model.llama import Transformer

    device = torch.device(args.device)
    size = ModelConfig(size=args.size)
    cfg = RunConfig.model_validate({
        "model": {"size": args.size, "vocab_size": args.vocab or size.vocab_size or 512,
                  "max_seq_len": max(size.max_seq_len, args.seq)},
        "train": {"batch_size": args.batch, "seq_len": args.seq, "lr": 1e-4, "warmup_steps": 0,
                  "precision": "bf16" if device.type == "cuda" else "fp32"}})
    torch.manual_seed(0)
    native = Transformer(cfg.model)
    hf = transformers.LlamaForCausalLM(hf_config(cfg.model, dtype="float32"))
    hf.load_state_dict(to_hf_state_dict(native.state_dict(), cfg.model.tie_embeddings), strict=False)
    if cfg.model.tie_embeddings:
        hf.tie_weights()
    hf.config.use_cache = False
    with tempfile.TemporaryDirectory() as data:
        results = [run("native", native, cfg, args, device, f"{data}/native")]
        del native
        free()
        results.append(run("auto", HFCausalLM(hf, cfg.model), cfg, args, device, f"{data}/auto"))

    n = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    print(f"{args.size} ({n / 1e6:.1f}M parameters), batch {args.batch} x {args.seq} tokens, {device_name(device)}, "
          f"compile={args.compile}, ac={args.ac}, doc_mask={args.doc_mask}")
    print(table(results, [("path", "name"), ("tokens/s", "tokens_per_s", ",.0f"), ("peak GiB", "peak_gib", ".2f"),
                          ("first loss", "first_loss", ".4f"), ("last loss", "last_loss", ".4f")]))
    print(f"auto / native: {results[1]['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x the native speed")


if __name__ == "__main__":
    main()
