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

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # benchmarks/ has scripts named like standard modules: don't shadow them

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

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
    _free()
    return out


def _free() -> None:
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run_kiln(base: Path, root: Path, steps: int, overrides: list[str]) -> dict:
    from rich.console import Console

    from kiln.config import load_config
    from kiln.train.run import run

    run_dir = root / "kiln-run"
    cfg = load_config("cpt-8b-1gpu", [f"model.init_from={base}", f"train.run_dir={run_dir}",
                                      f"train.max_steps={steps}", "train.eval_every=0", "train.sample_tokens=0",
                                      "logging.every=1", "checkpoint.every=0", "checkpoint.save_final=false",
                                      "data.max_bytes=20000000", f"data.cache_dir={root / 'cache'}", *overrides])
    _free()
    t0 = time.perf_counter()
    run(cfg, Console(quiet=True), resume="never")
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("event") == "train"]
    late = [r for r in rows if r["step"] > steps // 3]
    tps = statistics.median(r["tokens_per_s"] for r in late)
    return {"name": "kiln", "tokens_per_s": tps, "mfu": statistics.median(r.get("mfu", 0.0) or 0.0 for r in late),
            "peak_gib": _peak_gib(), "batch": cfg.train.batch_size, "accum": cfg.train.grad_accum,
            "seq": cfg.train.seq_len,
            "rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets),
            "ac": cfg.train.activation_checkpointing, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
            "wall_s": round(wall, 1)}


def run_peft(base: Path, kiln: dict, steps: int, device: str) -> dict:
    """PEFT LoRA of the same rank, alpha and targets under transformers.Trainer, same rows per step."""
    import peft
    import transformers

    _free()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(device)
    targets = [HF_TARGETS[t] for t in kiln["targets"]] if "all" not in kiln["targets"] else "all-linear"
    model = peft.get_peft_model(model, peft.LoraConfig(r=kiln["rank"], lora_alpha=kiln["alpha"],
                                                       target_modules=targets, task_type="CAUSAL_LM"))
    seq, batch, accum, vocab = kiln["seq"], kiln["batch"], kiln["accum"], 2048
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (64, seq), generator=g)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            r = rows[i % len(rows)]
            return {"input_ids": r, "labels": r}

    warm = steps // 3
    marks: dict[str, float] = {}

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warm:
                sync()
                marks["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == steps:
                sync()
                marks["t1"] = time.perf_counter()

    ac = kiln["ac"] != "none"
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=steps,
            bf16=device != "cpu",
            optim="adamw_torch_fused", learning_rate=2e-4, warmup_steps=2, logging_steps=steps, save_strategy="no",
            report_to="none", disable_tqdm=True, gradient_checkpointing=ac,
            gradient_checkpointing_kwargs={"use_reentrant": False} if ac else None, dataloader_num_workers=2,
            seed=0, use_cpu=device == "cpu")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Clock()])
        trainer.train()
    tps = (steps - warm) * batch * accum * seq / (marks["t1"] - marks["t0"])
    res = {"name": "peft+hf-trainer", "tokens_per_s": tps, "mfu": kiln["mfu"] * tps / kiln["tokens_per_s"],
           "peak_gib": _peak_gib(), "batch": batch, "accum": accum, "seq": seq, "rank": kiln["rank"],
           "ac": kiln["ac"]}
    del trainer, model
    _free()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override of the Kiln run")
    ap.add_argument("--no-peft", action="store_true", help="Kiln alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers

    overrides = list(args.set) + ([] if args.device == "cuda" else ["train.device=cpu", "train.compile=false",
                                                                     "train.seq_len=64", "train.grad_accum=1"])
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "size": args.size,
            "steps": args.steps, "overrides": overrides}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base = make_base(root, args.size, args.device)
        print(f"base model written in {time.perf_counter() - t0:.0f} s: {base}", flush=True)
        results = [run_kiln(base, root, args.steps, overrides)]
        print(json.dumps(results[-1]), flush=True)
        if not args.no_peft:
            results.append(run_peft(base, results[0], args.steps, args.device))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps(info))
    kiln = results[0]["tokens_per_s"]
    print(f"{'run':<16} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'Kiln':>6}")
    for r in results:
        print(f"{r['name']:<16} {r['tokens_per_s']:>10,.0f} {100 * r['mfu']:>5.1f}% {r['peak_gib']:>9.1f} "
              f"{kiln / r['tokens_per_s']:>5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
