"""QLoRA of an 8B model on one GPU: Kiln's cpt-8b-16gb preset (NF4 base through torchao) against PEFT +
bitsandbytes QLoRA under the Hugging Face Trainer, same model, rank, targets, batch and checkpointing, in one
process.

    python benchmarks/qlora.py --size 8b --steps 12 --json out.json     # Llama-3-8B shape, sequence 2048
    python benchmarks/qlora.py --size 1b --steps 8                      # a quicker look at a smaller shape
    python benchmarks/qlora.py --size tiny --device cpu --steps 3       # Kiln's side alone, a check of the script

1. Writes a Llama-shaped model (`--size`) with random weights in the Hugging Face layout (bf16 safetensors),
   as benchmarks/cpt_8b.py does.
2. Runs `kiln train cpt-8b-16gb model.init_from=THAT_DIR` (LoRA r=16 on every projection over a frozen base
   whose block linear layers are NF4, quantized on the GPU as the base loads; compile; full activation
   checkpointing; sequence 2048, micro-batch 1) for `--steps` steps.
3. Loads the same directory with `BitsAndBytesConfig(load_in_4bit, nf4, double quantization, bf16 compute)`,
   adds `peft.get_peft_model` adapters of the same rank, alpha and targets, and trains them under
   `transformers.Trainer` (bf16, adamw_torch_fused, non-reentrant gradient checkpointing) on rows of the same
   length and batch. The base's other weights stay bf16 on both sides (`prepare_model_for_kbit_training`
   would upcast them to fp32: slower and larger, so the baseline is left without it).
Tokens/s: the median of Kiln's logged rate after the first third of the steps, and the HF Trainer's rate
between the same steps. Peak memory: the largest allocated over each whole run. The bitsandbytes side needs
CUDA; on the CPU its row says so. Prints a table with Kiln's speed-up last and whether Kiln stayed under
`--budget-gib` (16).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/qlora.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import tempfile
import time

import torch

from benchmarks.common import run_info, table, write_json
from benchmarks.cpt_8b import make_base, run_kiln, run_peft

PRESET = "cpt-8b-16gb"


def bnb_config():
    """The QLoRA paper's quantization in transformers: NF4, double quantization, bf16 compute."""
    import transformers

    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b", help="model shape: 8b (Llama-3-8B), 3b, 1b, ... or tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-bytes", type=int, default=20_000_000, help="characters of the corpus Kiln prepares")
    ap.add_argument("--budget-gib", type=float, default=16.0, help="the memory Kiln's run must stay under")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override of the Kiln run")
    ap.add_argument("--no-hf", action="store_true", help="Kiln alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cpu = args.device != "cuda"
    overrides = list(args.set) + (["train.device=cpu", "train.compile=false", "train.precision=fp32",
                                   "train.seq_len=64", "train.grad_accum=1"] if cpu else [])
    info = run_info(torch.device(args.device), ["transformers", "peft", "torchao", "bitsandbytes"], size=args.size,
                    steps=args.steps, preset=PRESET, overrides=overrides)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base = make_base(root, args.size, args.device)
        print(f"base model written in {time.perf_counter() - t0:.0f} s: {base}", flush=True)
        kiln = run_kiln(base, root, args.steps, args.data_bytes, overrides, preset=PRESET)
        kiln["name"] = "kiln (NF4, torchao)"
        kiln["under_budget"] = None if cpu else "yes" if kiln["peak_gib"] < args.budget_gib else "NO"
        print(json.dumps(kiln), flush=True)
        results = [kiln]
        if not args.no_hf and not cpu:
            results.append(run_peft(base, kiln, args.steps, args.device, bnb_config(), "peft+bitsandbytes+hf-trainer"))
            results[-1]["under_budget"] = "yes" if results[-1]["peak_gib"] < args.budget_gib else "no"
            print(json.dumps(results[-1]), flush=True)
        elif not args.no_hf:
            results.append({"name": "peft+bitsandbytes+hf-trainer", "tokens_per_s": None,
                            "note": "not run: bitsandbytes' 4-bit training needs CUDA"})
    print(json.dumps(info))
    rate = kiln["tokens_per_s"]
    print(table(results, [("run", "name"), ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"),
                          ("peak GiB", "peak_gib", ".1f"), (f"under {args.budget_gib:g} GiB", "under_budget"),
                          ("Kiln", lambda r: rate / r["tokens_per_s"] if r.get("tokens_per_s") else None,
                           "{:.2f}x"), ("note", "note")]))
    if len(results) > 1 and results[1].get("tokens_per_s"):
        print(f"Kiln / PEFT + bitsandbytes: {rate / results[1]['tokens_per_s']:.2f}x")
    write_json(args.json, {**info, "budget_gib": args.budget_gib, "results": results})


if __name__ == "__main__":
    main()
