"""Training speed and memory of the native model against the `model.hf_class=auto` path, same Llama shape, one process.

    python benchmarks/hf_auto.py                                   # CPU, tiny, a few steps
    python benchmarks/hf_auto.py --device cuda --compile --runs 124m:16,1b:8 --seq 2048 --json out.json

For each size:batch of --runs, builds Kiln's `Transformer` and `transformers.LlamaForCausalLM` of the same shape
with the same weights (the native model's, mapped by kiln.model.hf), wraps the latter in
`kiln.model.hf_auto.HFCausalLM` (what `model.hf_class=auto` trains), and trains each through Kiln's own
`Trainer` and loader on the same random tokens (documents of random length, document masking on unless
--no-doc-mask): Kiln's AdamW (fused on CUDA), bf16 autocast on CUDA, `kiln.parallel` activation
checkpointing and per-block compile as asked. With --before, a third run trains the auto model as the path
ran before it took Kiln's attention, loss and precision (transformers' SDPA with its packed-sequence mask,
the loss on the full logits, an fp32 residual stream). Each run does --warmup steps (compilation included),
then --steps timed steps between two device synchronisations. Prints tokens/s, peak memory (from the first
timed step) and, per size, the auto path's speed and memory as fractions of the native one's against the goals
(at least 0.9x the speed, at most 1.2x the memory); the first losses agree (same function) as a check.
--json writes the results.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/hf_auto.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import tempfile

import torch

from benchmarks.common import device_name, free, peak_gib, run_info, seconds_per_call, table, write_json
from benchmarks.synthetic import random_loader

SPEED_GOAL, MEMORY_GOAL = 0.9, 1.2  # auto / native: tokens/s at least, peak memory at most


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
    batch, seq = cfg.train.batch_size, cfg.train.seq_len
    loader = random_loader(data, batch, seq, cfg.model.vocab_size, docs_per_row=4 * args.doc_mask,
                           batches=args.warmup + args.steps)
    trainer = Trainer(cfg, model, loader, None, device)
    losses = [trainer.train_step()[0].item() for _ in range(args.warmup)]
    if device.type == "cuda":  # the peak from here: training, not building (compiled graphs kept)
        torch.cuda.reset_peak_memory_stats(device)
    last = []
    seconds = seconds_per_call(lambda: last.append(trainer.train_step()[0]), args.steps, dev=device)
    loader.close()
    return {"size": cfg.model.size, "batch": batch, "name": name, "tokens_per_s": batch * seq / seconds,
            "peak_gib": peak_gib() or None, "first_loss": losses[0] if losses else None,
            "last_loss": last[-1].item()}


def as_before(model) -> None:
    """The auto model as the path trained before it took Kiln's attention, loss and precision."""
    model.base.set_attn_implementation("sdpa")
    model.own_attention = model.own_head = "as before"
    for hook in model._hooks:
        hook.remove()


def compare(size: str, batch: int, args, device: torch.device) -> list[dict]:
    import transformers

    from kiln.config import ModelConfig, RunConfig
    from kiln.model.hf import hf_config, to_hf_state_dict
    from kiln.model.hf_auto import HFCausalLM
    from kiln.model.llama import Transformer

    shape = ModelConfig(size=size)
    cfg = RunConfig.model_validate({
        "model": {"size": size, "vocab_size": args.vocab or shape.vocab_size or 512,
                  "max_seq_len": max(shape.max_seq_len, args.seq)},
        "train": {"batch_size": batch, "seq_len": args.seq, "lr": 1e-4, "warmup_steps": 0,
                  "precision": "bf16" if device.type == "cuda" else "fp32"}})
    torch.manual_seed(0)
    native = Transformer(cfg.model)
    # copied: the native run trains its weights in place, and each auto run starts from the same ones
    state = {k: v.clone() for k, v in to_hf_state_dict(native.state_dict(), cfg.model.tie_embeddings).items()}

    def auto(before: bool = False):
        hf = transformers.LlamaForCausalLM(hf_config(cfg.model, dtype="float32"))
        hf.load_state_dict(state, strict=False)
        if cfg.model.tie_embeddings:
            hf.tie_weights()
        hf.config.use_cache = False
        model = HFCausalLM(hf, cfg.model)
        if before:
            as_before(model)
        return model

    results = []
    with tempfile.TemporaryDirectory() as data:
        results.append(run("native", native, cfg, args, device, f"{data}/native"))
        del native
        free()
        model = auto()
        print(f"{size}: auto path: {model.describe_fast_path()}", flush=True)
        results.append(run("auto", model, cfg, args, device, f"{data}/auto"))
        del model
        free()
        if args.before:
            results.append(run("auto, as before", auto(before=True), cfg, args, device, f"{data}/before"))
            free()
    native_row = results[0]
    for r in results:
        r["speed_vs_native"] = r["tokens_per_s"] / native_row["tokens_per_s"]
        r["memory_vs_native"] = r["peak_gib"] / native_row["peak_gib"] if r["peak_gib"] else None
    return results


def add_run_args(ap) -> None:
    """The options of a step-timing run that families.py and generic_families.py share with this script's."""
    ap.add_argument("--device", default="cpu", help="cpu or cuda.")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="Timed steps.")
    ap.add_argument("--warmup", type=int, default=2, help="Untimed steps first (compilation included).")
    ap.add_argument("--vocab", type=int, default=None, help="Vocabulary (default: the size's, else 512).")
    ap.add_argument("--compile", action="store_true", help="Per-block torch.compile (kiln.parallel.compile).")
    ap.add_argument("--ac", default="none", choices=["none", "selective", "full"], help="Activation checkpointing.")
    ap.add_argument("--no-doc-mask", dest="doc_mask", action="store_false", help="One sequence per row.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=None, help="Comma-separated size:batch, e.g. 124m:16,1b:8 "
                                                 "(default: --size with --batch).")
    ap.add_argument("--size", default="tiny", help="Kiln model size (tiny, 124m, 350m, 1b, ...).")
    add_run_args(ap)  # --compile and --ac apply to both paths
    ap.add_argument("--before", action="store_true", help="Also the auto path as it ran before (its own attention "
                                                          "and masks, the loss on the full logits).")
    ap.add_argument("--json", default=None, help="Write the results here.")
    args = ap.parse_args()

    device = torch.device(args.device)
    runs = [(s, int(b)) for s, b in (r.split(":") for r in args.runs.split(","))] if args.runs \
        else [(args.size, args.batch)]
    results = []
    for size, batch in runs:
        results += compare(size, batch, args, device)
        write_json(args.json, {"info": run_info(device, ["transformers"], args=vars(args)), "results": results})

    print(f"batch x {args.seq} tokens, {device_name(device)}, compile={args.compile}, ac={args.ac}, "
          f"doc_mask={args.doc_mask}")
    print(table(results, [("size", "size"), ("batch", "batch", "d"), ("path", "name"),
                          ("tokens/s", "tokens_per_s", ",.0f"), ("peak GiB", "peak_gib", ".2f"),
                          ("speed vs native", "speed_vs_native", "{:.2f}x"),
                          ("memory vs native", "memory_vs_native", "{:.2f}x"),
                          ("first loss", "first_loss", ".4f"), ("last loss", "last_loss", ".4f")]))
    for r in (r for r in results if r["name"] == "auto"):
        speed, memory = r["speed_vs_native"], r["memory_vs_native"]
        met = speed >= SPEED_GOAL and (memory is None or memory <= MEMORY_GOAL)
        mem = f", {memory:.2f}x its memory" if memory is not None else ""
        print(f"{r['size']} auto / native: {speed:.2f}x the native speed{mem} (goal: at least {SPEED_GOAL}x the "
              f"speed, at most {MEMORY_GOAL}x the memory: {'met' if met else 'not met'})")


if __name__ == "__main__":
    main()
