"""Full training of an 8B model on one GPU capped at 24 GiB: Kiln's offload preset (`cpt-8b-24gb`, the optimizer in
host memory) against the Hugging Face Trainer with DeepSpeed ZeRO-2 and its CPU Adam (the optimizer offloaded to
host memory), same model, sequence, batch, accumulation and gradient checkpointing, in one call.

    python benchmarks/offload_8b.py --json out.json                        # Llama-3-8B shape, 24 GiB cap
    python benchmarks/offload_8b.py --shape nemotron-8b                    # vocabulary 256K, squared-ReLU MLP
    python benchmarks/offload_8b.py --shape 1b --cap-gib 8 --steps 2       # a quick check of both sides
    python benchmarks/offload_8b.py --shape tiny --device cpu --steps 2    # the script itself, on the CPU

1. Writes the model (`--shape`, random weights) in the Hugging Face layout: bf16 safetensors and a BPE tokenizer
   trained on the Python standard library (the model keeps its full vocabulary).
2. Kiln, in a process of its own: `kiln train cpt-8b-24gb model.init_from=THAT_DIR` (bf16 weights on the GPU,
   fp32 masters and AdamW in host memory, full activation checkpointing, compile; sequence 4096, batch 1,
   accumulation 8) for --warmup + --steps optimizer steps.
3. The HF Trainer, in a process of its own: `AutoModelForCausalLM.from_pretrained(THAT_DIR, dtype=bf16)` with
   DeepSpeed ZeRO stage 2, `offload_optimizer: cpu` (pinned) and DeepSpeed's AdamW (its CPU Adam, JIT-compiled
   on first use: it needs a C++ compiler; if it cannot be built, the table says so and Kiln's side still runs),
   bf16, gradient checkpointing, the same batch, accumulation, learning rate, clipping and steps, on rows of
   random token ids.

Each process caps its GPU memory with torch.cuda.set_per_process_memory_fraction at --cap-gib (24: an RTX 4090 has
23.99 GiB) before anything is allocated, and DeepSpeed is shown a card of that size (it sizes its buffers by the
driver's free memory, which the cap does not change). Tokens/s is the median of Kiln's logged rate over the steps
after --warmup (each step's rate is logged from one step's end to the next's; the offload's AdamW runs beside the
next step's forward pass, so a step's interval carries the AdamW of the step before it, and the first AdamW, which
touches the moments' memory for the first time, takes twice a later one's: the default --warmup 2 keeps it out),
and the HF Trainer's rate over the same steps (timed between device synchronisations). Peak GPU
memory is torch.cuda.max_memory_allocated over the whole run; host memory is each process's peak resident set
(pinned buffers included). Prints one table with Kiln's speed-up last and writes --json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/offload_8b.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sysconfig
import tempfile
import time
import traceback

import torch

from benchmarks.common import hf_rows, hf_step_clock, peak_gib, run_info, table, write_json
from benchmarks.hf_worker import allocator_env

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
GIB = 2**30
# model shapes (kiln.config.ModelConfig fields over model.size); nemotron-8b: Nemotron-3-8B's (no GQA assumed)
SHAPES = {
    "llama3-8b": {"size": "8b"},
    "nemotron-8b": {"size": "8b", "vocab_size": 256000, "mlp": "relu2", "ffn_hidden": 16384, "norm": "layernorm1p",
                    "rotary_fraction": 0.5, "n_kv_heads": 32, "max_seq_len": 4096, "rope_theta": 10000.0},
    # Llama-3-8B's layers, half as many (4.5B): a host with 128 GiB holds both sides' state
    "llama3-8b-16l": {"size": "8b", "n_layers": 16},
    "3b": {"size": "3b", "max_seq_len": 4096},  # Llama-3.2-3B's shape
    "1b": {"size": "1b", "vocab_size": 32000, "max_seq_len": 4096},  # 4096 positions: both sides train at 4096
    "tiny": {"size": "tiny", "vocab_size": 2048},
}
TOKENS = 2048  # the tokenizer's vocabulary: data ids stay below it whatever the model's vocabulary


def model_config(shape: str):
    from kiln.config import ModelConfig

    return ModelConfig(**SHAPES[shape])


def make_base(root: Path, shape: str, device: str) -> Path:
    """A random-weight model of `shape` in the Hugging Face layout, with a Kiln-trained tokenizer."""
    import transformers

    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.model.hf import hf_config

    out = root / f"base-{shape}"
    texts = [(STDLIB / n).read_text() for n in ("argparse.py", "textwrap.py", "difflib.py", "csv.py")]
    tok = train_bpe(texts, TOKENS)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # 8B weights are drawn on the GPU in seconds, on the CPU in minutes
            model = transformers.AutoModelForCausalLM.from_config(hf_config(model_config(shape)))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    tok.save(out / "tokenizer.json")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def cap_gpu(gib: float, device: str) -> None:
    """This process may allocate at most `gib` GiB of the GPU (before anything is allocated)."""
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total))


def host_peak_gb() -> float:
    """This process's peak resident set, in GB (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def settings(args) -> dict:
    """What both sides train with: the preset's, or the CPU's small ones."""
    if args.device == "cpu":
        return {"seq": 64, "batch": 1, "accum": 2, "lr": 3e-5}
    return {"seq": 4096, "batch": 1, "accum": 8, "lr": 3e-5}


def watch_phases(log: list) -> None:
    """--timeline: marks (name, host seconds, CUDA event or None) at the offloaded step's phase boundaries: where the
    training thread and the GPU are when the forward pass is issued, the last step's AdamW is waited for, each
    layer's gradients are finished (the head first, the embedding last), and the step's AdamW starts and ends."""
    from kiln.parallel import offload, offload_layers

    def mark(name: str, gpu: bool = True) -> None:
        event = None
        if gpu and torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        log.append((name, time.perf_counter(), event))

    def around(owner, attr: str, before: str | None, after: str, gpu: bool = True) -> None:
        inner = getattr(owner, attr)

        def wrapped(*a, **k):
            if before:
                mark(before, gpu)
            out = inner(*a, **k)
            mark(after, gpu)
            return out
        setattr(owner, attr, wrapped)

    around(offload.OptimizerOffload, "accumulate", "step start", "backward issued")
    around(offload_layers.Kept, "sealed", None, "forward issued")
    around(offload.OptimizerOffload, "settle", None, "settled")
    around(offload_layers, "_finish", None, "layer finished")
    around(offload.OptimizerOffload, "step", "optimizer step", "adamw started")
    around(offload.OptimizerOffload, "_steps", None, "adamw done (host)", gpu=False)


def last_steps_timeline(log: list) -> list:
    """The last two steps' marks as [name, host s, GPU s] from the first one's start (the GPU's: when the stream
    reached the mark; None on the CPU): the second's forward pass runs beside the first's AdamW."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    starts = [i for i, m in enumerate(log) if m[0] == "step start"]
    if len(starts) < 2:
        return []
    lo = starts[-2]
    name0, host0, ev0 = log[lo]
    rows, finished = [], 0
    for name, host, ev in log[lo:]:
        if name == "layer finished":
            finished += 1
            if finished not in (1, 2, 17, 33, 34):
                continue
            name = f"layer finished #{finished}"
        elif name == "step start":
            finished = 0
        rows.append([name, round(host - host0, 3), round(ev0.elapsed_time(ev) / 1e3, 3) if ev and ev0 else None])
    return rows


def side_kiln(args, base: Path, root: Path) -> dict:
    from rich.console import Console

    from kiln.config import load_config
    from kiln.events import Callback
    from kiln.train.run import run

    s = settings(args)
    steps = args.warmup + args.steps
    run_dir = root / "kiln-run"
    over = [f"model.init_from={base}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "train.warmup_steps=1",
            "train.eval_every=0", "train.sample_tokens=0", "logging.every=1", "logging.console=false",
            "logging.plots=false", "checkpoint.every=0", "checkpoint.at_end=false",
            "checkpoint.save_final=false", "train.eval_batches=1",
            f"data.max_bytes={args.data_bytes}", f"data.cache_dir={root / 'cache'}", f"train.seq_len={s['seq']}",
            f"train.grad_accum={s['accum']}", f"train.lr={s['lr']}"]
    if args.device == "cpu":
        over += ["train.device=cpu", "train.precision=fp32", "train.compile=false"]
    cfg = load_config("cpt-8b-24gb", over + list(args.set))
    host: dict = {}
    marks: list = []
    if args.timeline:
        watch_phases(marks)

    class HostTimes(Callback):  # where the host's time per step goes (kiln.parallel.offload)
        def on_step_end(self, trainer, metrics):
            o = trainer.offload
            if o is not None and trainer.step == args.warmup:
                # not waited for: that wait would land in the next step's interval, and the rate with it. The
                # warm-up's AdamW, if it still runs beside the next forward pass, adds its seconds later, so it is
                # counted among the timed steps' AdamW runs
                host["from"] = (dict(o.seconds), o.steps - (o._thread is not None))

        def on_train_end(self, trainer, final):
            o = trainer.offload
            if o is not None:
                o.settle()  # the last step's AdamW may still run in its thread: its seconds count too
                (before, n) = host.get("from", (dict.fromkeys(o.seconds, 0.0), 0))
                steps = max(1, o.steps - n)
                host.update(sums_wait_s=(o.seconds["sums"] - before["sums"]) / steps,
                            host_step_s=(o.seconds["step"] - before["step"]) / steps,
                            host_norm_s=(o.seconds["norm"] - before["norm"]) / steps, layered=o.layered)
            if marks:
                host["timeline"] = last_steps_timeline(marks)
                for row in host["timeline"]:
                    print("timeline", *row, flush=True)

    t0 = time.perf_counter()
    run(cfg, Console(quiet=True), resume="never", callbacks=[HostTimes()])
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("event") == "train"]
    late = [r for r in rows if r["step"] > args.warmup] or rows
    tps = statistics.median(r["tokens_per_s"] for r in late)
    tokens = cfg.train.step_rows(1) * cfg.train.seq_len
    return {"name": "kiln cpt-8b-24gb (train.offload)", "tokens_per_s": tps,
            "step_s": tokens / tps, "steps_s": [round(tokens / r["tokens_per_s"], 3) for r in late],
            "peak_gib": max([peak_gib(), *(r.get("peak_mem_gib") or 0.0 for r in rows)]),
            "host_gb": host_peak_gb(), "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
            "wall_s": round(wall, 1), "sums_wait_s": host.get("sums_wait_s"), "host_step_s": host.get("host_step_s"),
            "host_norm_s": host.get("host_norm_s"), "layered": host.get("layered"), "timeline": host.get("timeline"),
            **s}


def deepspeed_config(s: dict) -> dict:
    """ZeRO-2, the optimizer (DeepSpeed's AdamW: its CPU Adam) offloaded to pinned host memory, bf16."""
    return {"bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}


def see_capped_card(gib: float) -> None:
    """Make DeepSpeed's accelerator report a card of `gib` GiB. ZeRO-2 flattens the bf16 weights into one buffer on
    the GPU when the driver's free memory allows it, else on the host first: on a large card capped by
    set_per_process_memory_fraction it would take the GPU path and exceed the cap, which a real 24 GB card avoids."""
    from deepspeed.accelerator import get_accelerator

    acc, cap = get_accelerator(), int(gib * GIB)
    acc.total_memory = lambda device_index=None: cap
    acc.available_memory = lambda device_index=None: max(0, cap - torch.cuda.memory_reserved())


def side_hf(args, base: Path, root: Path) -> dict:
    s = settings(args)
    try:
        import deepspeed  # noqa: F401 - the baseline's engine; not a Kiln dependency
    except ImportError as e:
        return {"name": "hf-trainer + deepspeed zero-2 offload", "error": f"DeepSpeed is not installed ({e}); "
                "pip install deepspeed (scripts/device_wheels.sh builds its wheel)"}
    import transformers

    if args.device == "cuda":  # DeepSpeed sizes its buffers by the card's free memory: show it the capped card
        see_capped_card(args.hf_cap_gib or args.cap_gib)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    steps = args.warmup + args.steps
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, TOKENS, (64, s["seq"]), generator=g)
    clock = hf_step_clock(args.warmup, steps)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=s["batch"], gradient_accumulation_steps=s["accum"],
            max_steps=steps, bf16=True, learning_rate=s["lr"], warmup_steps=1, weight_decay=0.1, adam_beta2=0.95,
            max_grad_norm=1.0, lr_scheduler_type="cosine", logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            deepspeed=deepspeed_config(s), dataloader_num_workers=2, seed=0)
        try:
            trainer = transformers.Trainer(model=model, args=targs, train_dataset=hf_rows(rows), callbacks=[clock])
            trainer.train()
        except Exception as e:  # noqa: BLE001 - the table says what stopped the baseline
            text = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
            built = "cpu_adam" in repr(e).lower() or "ninja" in repr(e).lower() or "compil" in repr(e).lower()
            why = "DeepSpeed's CPU Adam could not be built (JIT, needs g++ and ninja)" if built else \
                "the HF Trainer with DeepSpeed failed"
            print(traceback.format_exc(), file=sys.stderr)
            return {"name": "hf-trainer + deepspeed zero-2 offload", "error": f"{why}: {text[-1][:300]}",
                    "peak_gib": peak_gib(), "host_gb": host_peak_gb()}
    tps = args.steps * s["batch"] * s["accum"] * s["seq"] / clock.seconds
    return {"name": "hf-trainer + deepspeed zero-2 offload", "tokens_per_s": tps, "step_s": clock.seconds / args.steps,
            "peak_gib": peak_gib(), "host_gb": host_peak_gb(), "first_loss": (clock.losses or [None])[0],
            "last_loss": (clock.losses or [None])[-1], "wall_s": round(time.perf_counter() - t0, 1),
            "deepspeed": deepspeed.__version__, **s}


def child(args) -> None:
    """One side, in this process: cap the GPU, train, write the result to --result."""
    cap_gpu(args.hf_cap_gib if args.side == "hf" and args.hf_cap_gib else args.cap_gib, args.device)
    base, root = Path(args.base), Path(args.root)
    try:
        res = side_kiln(args, base, root) if args.side == "kiln" else side_hf(args, base, root)
    except Exception as e:  # noqa: BLE001 - reported in the table; the traceback goes to stderr
        print(traceback.format_exc(), file=sys.stderr)
        res = {"name": args.side, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
               "peak_gib": peak_gib(), "host_gb": host_peak_gb()}
    Path(args.result).write_text(json.dumps(res))


def run_side(args, side: str, base: Path, root: Path) -> dict:
    """One side in a process of its own (its GPU cap, peaks and host memory its own; on the CPU, in this one)."""
    if side == "hf" and importlib.util.find_spec("deepspeed") is None:
        return {"name": "hf-trainer + deepspeed zero-2 offload", "error": "DeepSpeed is not installed; pip install "
                "deepspeed (scripts/device_wheels.sh builds its wheel)"}
    if args.device == "cpu":
        return side_kiln(args, base, root) if side == "kiln" else side_hf(args, base, root)
    result = root / f"{side}.json"
    cmd = [sys.executable, "-m", "benchmarks.offload_8b", "--side", side, "--base", str(base), "--root", str(root),
           "--result", str(result), "--shape", args.shape, "--device", args.device, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--cap-gib", str(args.cap_gib), "--data-bytes", str(args.data_bytes)]
    if args.hf_cap_gib:
        cmd += ["--hf-cap-gib", str(args.hf_cap_gib)]
    for s in args.set:
        cmd += ["--set", s]
    if args.timeline:
        cmd.append("--timeline")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **allocator_env(), "PYTHONPATH": path}  # Kiln's allocator setting on both sides
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    res = json.loads(result.read_text()) if result.is_file() else \
        {"name": side, "error": f"the {side} process ended with code {done.returncode} and no result"}
    print(f"{side}: {time.perf_counter() - t0:.0f} s: {json.dumps(res)}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps timed, after --warmup")
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed (see above: at least 2 for Kiln)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory each side may allocate")
    ap.add_argument("--hf-cap-gib", type=float, default=None,
                    help="the HF Trainer's own cap (default: --cap-gib), for a baseline that does not fit it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-bytes", type=int, default=3_000_000, help="characters of the corpus Kiln prepares")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override of the Kiln run")
    ap.add_argument("--no-deepspeed", action="store_true", help="Kiln alone")
    ap.add_argument("--timeline", action="store_true", help="print where the last two steps' time goes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--side", choices=["kiln", "hf"], help=argparse.SUPPRESS)  # a child process's side
    for hidden in ("--base", "--root", "--result"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return child(args)

    dev = torch.device(args.device)
    info = run_info(dev, ["transformers", "deepspeed"], shape=args.shape, steps=args.steps, warmup=args.warmup,
                    cap_gib=args.cap_gib, hf_cap_gib=args.hf_cap_gib or args.cap_gib, overrides=args.set)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base = make_base(root, args.shape, args.device)
        print(f"base model written in {time.perf_counter() - t0:.0f} s: {base}", flush=True)
        results = [run_side(args, "kiln", base, root)]
        if not args.no_deepspeed:
            results.append(run_side(args, "hf", base, root))
    print(json.dumps(info))
    kiln = results[0].get("tokens_per_s")
    k = results[0]
    if k.get("host_step_s") is not None:
        print(f"Kiln's host, per step after the warm-up: {k['sums_wait_s']:.2f} s waiting for the last gradients to "
              f"be summed after the backward pass, {k['host_step_s']:.2f} s of step (norm, clipping, AdamW, copies "
              f"back; the norm and clipping {k['host_norm_s']:.2f} s), of {k['step_s']:.2f} s a step"
              + (" (layer by layer)" if k.get("layered") else ""))
    print(table(results, [("run", "name"), ("tokens/s", "tokens_per_s", ",.0f"), ("step s", "step_s", ".1f"),
                          ("peak GPU GiB", "peak_gib", ".1f"), ("host peak GB", "host_gb", ".1f"),
                          ("Kiln", lambda r: kiln / r["tokens_per_s"] if kiln and r.get("tokens_per_s") else None,
                           "{:.2f}x")]))
    hf_cap = f"; the HF Trainer's at {args.hf_cap_gib:g} GiB" if args.hf_cap_gib else ""
    print(f"GPU capped at {args.cap_gib:g} GiB per process{hf_cap} ({info['device']})")
    for r in results:
        if r.get("error"):
            print(f"{r['name']}: {r['error']}")
    write_json(args.json, {**info, "results": results})
    if results[0].get("error"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
