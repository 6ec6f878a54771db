"""Continued pretraining of an 8B model on one GPU: Kiln's LoRA preset against PEFT LoRA under the Hugging Face
Trainer, same model, same batch, in one process.

    python benchmarks/cpt_8b.py --size 8b --steps 12 --json out.json
    python benchmarks/cpt_8b.py --size tiny --device cpu --steps 4      # a quick check of the script itself

1. Writes a Llama-shaped model (`--size`, Llama-3-8B by default) with random weights in the Hugging Face
   layout (bf16 safetensors, sharded, with a tokenizer trained on the Python standard library).
2. Runs `kiln train cpt-8b-1gpu model.init_from=THAT_DIR` (the preset as users run it: LoRA on every linear
   layer, a frozen bf16 base, compile and activation checkpointing) for `--steps` steps.
3. Runs `peft.get_peft_model` with the same rank, alpha and target modules on
   `LlamaForCausalLM.from_pretrained(THAT_DIR, dtype=bf16)` under `transformers.Trainer` (bf16,
   adamw_torch_fused, gradient checkpointing as the preset's activation checkpointing) on rows of the same
   length and batch.
Tokens/s is the median of Kiln's logged rate after the first third of the steps, and the HF Trainer's rate
between the same steps. Prints a table with Kiln's speed-up last.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/cpt_8b.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import sysconfig
import tempfile
import time

import torch

from benchmarks.common import free, hf_rows, hf_step_clock, peak_gib, run_info, table, write_json

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}


def make_base(root: Path, size: str, device: str) -> Path:
    """A random-weight Llama of `size` in the Hugging Face layout, with a Kiln-trained tokenizer."""
    import transformers

    from kiln.config import ModelConfig
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.model.hf import hf_config

    out = root / f"llama-{size}"
    texts = [(STDLIB / n).read_text() for n in ("argparse.py", "textwrap.py", "difflib.py", "csv.py")]
    tok = train_bpe(texts, 2048)
    mcfg = ModelConfig(size=size, vocab_size=128256 if size in ("8b", "3b") else 2048, max_seq_len=8192)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # initialising 8B weights on the GPU takes seconds, on the CPU minutes
            model = transformers.LlamaForCausalLM(hf_config(mcfg))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    tok.save(out / "tokenizer.json")
    del model
    free()
    return out


def run_kiln(base: Path, root: Path, steps: int, data_bytes: int, overrides: list[str],
             preset: str = "cpt-8b-1gpu") -> dict:
    from rich.console import Console

    from kiln.config import load_config
    from kiln.train.run import run

    run_dir = root / "kiln-run"
    cfg = load_config(preset, [f"model.init_from={base}", f"train.run_dir={run_dir}",
                               f"train.max_steps={steps}", "train.eval_every=0", "train.sample_tokens=0",
                               "logging.every=1", "checkpoint.every=0", "checkpoint.save_final=false",
                               f"data.max_bytes={data_bytes}", f"data.cache_dir={root / 'cache'}", *overrides])
    free()
    t0 = time.perf_counter()
    run(cfg, Console(quiet=True), resume="never")
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("event") == "train"]
    late = [r for r in rows if r["step"] > steps // 3]
    tps = statistics.median(r["tokens_per_s"] for r in late)
    return {"name": "kiln", "tokens_per_s": tps, "mfu": statistics.median(r.get("mfu", 0.0) or 0.0 for r in late),
            # the peak of the whole run, as the HF side's: each logging step's read resets the device's peak
            "peak_gib": max([peak_gib(), *(r.get("peak_mem_gib") or 0.0 for r in rows)]),
            "batch": cfg.train.batch_size, "accum": cfg.train.grad_accum, "seq": cfg.train.seq_len,
            "rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets),
            "ac": cfg.train.activation_checkpointing, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
            "wall_s": round(wall, 1)}


def run_peft(base: Path, kiln: dict, steps: int, device: str, quantization_config=None,
             name: str = "peft+hf-trainer") -> dict:
    """PEFT LoRA of the same rank, alpha and targets under transformers.Trainer, same rows per step;
    `quantization_config` (a transformers BitsAndBytesConfig): the base quantized as it loads (QLoRA)."""
    import peft
    import transformers

    free()
    if quantization_config is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(device)
    else:  # bitsandbytes quantizes each weight on the GPU as it is placed there
        model = transformers.AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.bfloat16, quantization_config=quantization_config, device_map={"": device})
    targets = [HF_TARGETS[t] for t in kiln["targets"]] if "all" not in kiln["targets"] else "all-linear"
    model = peft.get_peft_model(model, peft.LoraConfig(r=kiln["rank"], lora_alpha=kiln["alpha"],
                                                       target_modules=targets, task_type="CAUSAL_LM"))
    seq, batch, accum, vocab = kiln["seq"], kiln["batch"], kiln["accum"], 2048
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (64, seq), generator=g)
    warm = steps // 3
    clock = hf_step_clock(warm, steps)
    ac = kiln["ac"] != "none"
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=steps,
            bf16=device != "cpu",
            optim="adamw_torch_fused", learning_rate=2e-4, warmup_steps=2, logging_steps=steps, save_strategy="no",
            report_to="none", disable_tqdm=True, gradient_checkpointing=ac,
            gradient_checkpointing_kwargs={"use_reentrant": False} if ac else None, dataloader_num_workers=2,
            seed=0, use_cpu=device == "cpu")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=hf_rows(rows), callbacks=[clock])
        trainer.train()
    tps = (steps - warm) * batch * accum * seq / clock.seconds
    res = {"name": name, "tokens_per_s": tps, "mfu": kiln["mfu"] * tps / kiln["tokens_per_s"],
           "peak_gib": peak_gib(), "batch": batch, "accum": accum, "seq": seq, "rank": kiln["rank"],
           "ac": kiln["ac"]}
    del trainer, model
    free()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-bytes", type=int, default=20_000_000, help="characters of the corpus Kiln prepares")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override of the Kiln run")
    ap.add_argument("--no-peft", action="store_true", help="Kiln alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    overrides = list(args.set) + ([] if args.device == "cuda" else ["train.device=cpu", "train.compile=false",
                                                                     "train.seq_len=64", "train.grad_accum=1"])
    info = run_info(torch.device(args.device), ["transformers", "peft"], size=args.size, steps=args.steps,
                    overrides=overrides)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base = make_base(root, args.size, args.device)
        print(f"base model written in {time.perf_counter() - t0:.0f} s: {base}", flush=True)
        results = [run_kiln(base, root, args.steps, args.data_bytes, overrides)]
        print(json.dumps(results[-1]), flush=True)
        if not args.no_peft:
            results.append(run_peft(base, results[0], args.steps, args.device))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps(info))
    kiln = results[0]["tokens_per_s"]
    print(table(results, [("run", "name"), ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"),
                          ("peak GiB", "peak_gib", ".1f"), ("Kiln", lambda r: kiln / r["tokens_per_s"], "{:.2f}x")]))
    write_json(args.json, {**info, "results": results})


if __name__ == "__main__":
    main()
