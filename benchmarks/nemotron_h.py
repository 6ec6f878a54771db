"""A Nemotron-H-8B-shaped hybrid (Mamba-2, attention, MLP layers) with FSDP2 on N GPUs at sequence 8192: Kiln's
native model beside the Hugging Face Trainer and beside Kiln's `model.hf_class=auto` path, in one call.

    python benchmarks/nemotron_h.py --nproc 4                                   # the 4-GPU measurement (8b shape)
    python benchmarks/nemotron_h.py --nproc 1 --shape small --seq 4096          # one GPU, a small hybrid
    python benchmarks/nemotron_h.py --shape tiny --device cpu --nproc 1 --steps 3 --seq 64   # a smoke test

Shapes (8b: nvidia/Nemotron-H-8B-Base-8K's config: d 4096, 52 layers M-M-M-M*-M-M-M-M-M*-... (24 Mamba-2, 4
attention, 24 MLP), attention 32 query / 8 key-value heads of 128 without position embeddings, squared-ReLU MLP
of 21504, Mamba-2 128 heads of 64 channels, state 128, 8 groups, conv 4, chunk 128, vocab 131072, untied):
    8b     8.10B parameters.
    small  d 1024, 14 layers (6 Mamba-2, 2 attention, 6 MLP), vocab 32000 (one GPU).
    tiny   d 64, 4 layers (the CPU smoke test).

(a) Kiln native: `kiln train --nproc N` with model.layer_pattern and model.mamba (kiln.model.mamba2: the SSD
    scan of kiln.model.ssd compiled per block, no mamba-ssm kernels), dist.strategy=fsdp (each layer sharded),
    batch 1 per GPU, bf16, compile per block (GPU), activation checkpointing --ac, random init, on the standard
    library corpus (tokenized once into --cache-dir), each packed document kept apart (attention masks, the
    convolution and the scan restarted at each document).
(b) The Hugging Face Trainer: NemotronHForCausalLM of the same config, random init, bf16, fused AdamW, batch 1 per
    GPU, FSDP2 through accelerate wrapping each NemotronHBlock, its own activation checkpointing; random token ids.
    transformers runs its PyTorch path for the Mamba layers (its chunked scan and conv1d): mamba-ssm and
    causal-conv1d, whose kernels it would use, are not installed, as on the GPU machine Kiln is measured on.
(c) Kiln `model.hf_class=auto`: the same loop on transformers' NemotronHForCausalLM (model.init_from: the native
    model's random weights written in the Hugging Face layout, bf16, by Kiln's export), compiled per block,
    FSDP2 per block, without document masks (the HF Trainer's work: one causal sequence a row); --auto-doc-mask
    turns them on, and it then runs each packed document as its own sequence (its Mamba layers would otherwise
    carry their state across documents).

tokens/s per GPU and MFU are medians over the steps after --warmup; every MFU uses Kiln's FLOPs per token
(kiln.model.registry.flops_per_token: 6 N, attention's 12 q T per attention layer, the scan's chunked products)
and the card's peak. Peak memory is torch.cuda.max_memory_allocated from the first training step on. The table
is printed and appended, dated and with the card's name, to benchmarks/results/nemotron_h.md; --json writes the
numbers. --sides runs a subset (the three take about 10 minutes at 8b on 4 GPUs: split them over calls if a call
is limited).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/nemotron_h.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import signal
import tempfile
import time

from benchmarks import hf_worker
from benchmarks.fsdp_8b import Job, fmt, kiln_phases, peak_flops, print_phases, publish, speed, stop_jobs, train_records

RESULTS = Path(__file__).parent / "results" / "nemotron_h.md"
PATTERN_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

# layer pattern, d, attention heads / kv heads / head dim, MLP hidden, Mamba heads / head dim / state / groups / chunk
SHAPES = {
    "8b": dict(pattern=PATTERN_8B, d=4096, heads=32, kv=8, head=128, ffn=21504, m_heads=128, m_head=64, state=128,
               groups=8, chunk=128, vocab=131072),
    "small": dict(pattern="M-M-M*-M-M-M*-", d=1024, heads=8, kv=2, head=128, ffn=4096, m_heads=32, m_head=64,
                  state=64, groups=4, chunk=128, vocab=32000),
    "tiny": dict(pattern="M*-M", d=64, heads=4, kv=2, head=16, ffn=128, m_heads=8, m_head=16, state=16, groups=2,
                 chunk=16, vocab=512),
}


def model_config(s: dict, seq: int):
    """Kiln's ModelConfig of shape `s`."""
    from kiln.config import MambaConfig, ModelConfig

    return ModelConfig(vocab_size=s["vocab"], d_model=s["d"], n_layers=len(s["pattern"]), n_heads=s["heads"],
                       n_kv_heads=s["kv"], head_size=s["head"], ffn_hidden=s["ffn"], mlp="relu2", norm="rmsnorm",
                       tie_embeddings=False, max_seq_len=max(seq, 64), layer_pattern=s["pattern"],
                       mamba=MambaConfig(heads=s["m_heads"], head_dim=s["m_head"], state=s["state"],
                                         groups=s["groups"], chunk=s["chunk"]))


def common_flags(args, run_dir: Path) -> list[str]:
    cuda = args.device == "cuda"
    return [f"train.seq_len={args.seq}", "train.batch_size=1", "train.grad_accum=1", f"train.max_steps={args.steps}",
            f"train.device={args.device}", f"train.precision={'bf16' if cuda else 'fp32'}",
            f"train.compile={str(cuda and not args.no_compile).lower()}", f"train.activation_checkpointing={args.ac}",
            "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0", "train.warmup_steps=2",
            f"train.lr={hf_worker.LR}",
            "logging.every=1", "logging.plots=false", "logging.console=false", "checkpoint.save_final=false",
            "checkpoint.at_end=false", "checkpoint.every=0", "dist.strategy=fsdp", "dist.sharding=full",
            f"data.cache_dir={args.cache_dir}", f"train.run_dir={run_dir}", *args.set, "--nproc", str(args.nproc)]


def native_command(args, s: dict, run_dir: Path) -> list[str]:
    model = [f"model.vocab_size={s['vocab']}", f"model.d_model={s['d']}", f"model.n_layers={len(s['pattern'])}",
             f"model.layer_pattern={s['pattern']}", f"model.n_heads={s['heads']}", f"model.n_kv_heads={s['kv']}",
             f"model.head_size={s['head']}", f"model.ffn_hidden={s['ffn']}", "model.mlp=relu2", "model.norm=rmsnorm",
             "model.tie_embeddings=false", f"model.max_seq_len={max(args.seq, 64)}",
             f"model.mamba.heads={s['m_heads']}", f"model.mamba.head_dim={s['m_head']}",
             f"model.mamba.state={s['state']}", f"model.mamba.groups={s['groups']}", f"model.mamba.chunk={s['chunk']}"]
    return [sys.executable, "-m", "kiln.cli", "train", *model, f"data.vocab_size={min(s['vocab'], 32000)}",
            *common_flags(args, run_dir)]


def auto_command(args, model_dir: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "kiln.cli", "train", f"model.init_from={model_dir}", "model.hf_class=auto",
            f"data.document_mask={'split' if args.auto_doc_mask else 'false'}", *common_flags(args, run_dir)]


def kiln_result(job: Job, run_dir: Path, args) -> dict:
    code = job.wait()
    recs = {r["step"]: r for r in train_records(run_dir)}
    if max(recs, default=0) < args.steps:
        return {"error": f"kiln train failed ({code}):\n{job.text(3000)}"}
    late = [st for st in recs if st > args.warmup] or list(recs)
    return {**speed(recs, late),
            "wall_s": job.t_end - job.t0, "exit_code": code, "phases": kiln_phases(job, recs)}


def write_model(s: dict, seq: int, tokenizer: str | None, out: str, device: str) -> None:
    """The native model of shape `s`, initialised as Kiln initialises it (on `device`), written to `out` in the
    Hugging Face layout in bf16 with `tokenizer` (None: a BPE trained here on standard library files), by Kiln's
    export: model.init_from of the auto side."""
    import sysconfig

    import torch

    from kiln.data.prepare.tokenizer import Tokenizer, train_bpe
    from kiln.model.llama import Transformer
    from kiln.state.export import export_hf

    if tokenizer is None:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
        tok = train_bpe((f.read_text(errors="replace") for f in files), min(s["vocab"], 32000))
    else:
        tok = Tokenizer.load(tokenizer)
    cfg = model_config(s, seq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights()
    export_hf(model.state_dict(), cfg, tok, out, dtype="bf16")


def run_auto(args, s: dict, root: Path) -> dict:
    vocab = min(s["vocab"], 32000)
    tokenizers = sorted(Path(args.cache_dir).glob(f"tokenizers/bpe-{vocab}-*/tokenizer.json"),
                        key=lambda p: p.stat().st_mtime)
    model_dir = root / "model"  # the native side's tokenizer where it ran (its data is then tokenized already)
    spec = json.dumps({"shape": s, "seq": args.seq, "tokenizer": str(tokenizers[-1]) if tokenizers else None,
                       "out": str(model_dir),
                       "device": "cuda" if args.device == "cuda" else "cpu"})
    writer = Job([sys.executable, str(Path(__file__).resolve()), "--write-model", spec], root / "write.log")
    if writer.wait() != 0:
        return {"error": f"writing the model directory failed:\n{writer.text(2000)}"}
    written = writer.t_end - writer.t0
    job = Job(auto_command(args, model_dir, root / "auto"), root / "auto.log")
    out = kiln_result(job, root / "auto", args)
    out["model_dir_write_s"] = round(written, 1)
    return out


def run_hf(args, s: dict, root: Path) -> dict:
    config = dict(vocab_size=s["vocab"], hidden_size=s["d"], hybrid_override_pattern=s["pattern"],
                  num_hidden_layers=len(s["pattern"]), num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                  head_dim=s["head"], intermediate_size=s["ffn"], mamba_num_heads=s["m_heads"],
                  mamba_head_dim=s["m_head"], ssm_state_size=s["state"], n_groups=s["groups"], conv_kernel=4,
                  chunk_size=s["chunk"], max_position_embeddings=args.seq, layer_norm_epsilon=1e-5,
                  tie_word_embeddings=False, use_cache=False)
    spec = {"model": "NemotronHForCausalLM", "config_class": "NemotronHConfig", "config": config,
            "layer": "NemotronHBlock", "tokens": min(s["vocab"], 32000), "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "ac": args.ac, "device": args.device, "out": str(root / "hf"), "t0": time.time()}
    job = Job(hf_worker.command(spec, args.nproc), root / "hf.log", env=hf_worker.env())
    code = job.wait()
    out = hf_worker.parse(x for _, x in job.lines)
    if code != 0 or out is None:
        return {"error": job.text(1500)}
    from kiln.model.registry import flops_per_token

    peak = peak_flops(args.device)
    out["mfu"] = out["tokens_per_s_per_gpu"] * flops_per_token(model_config(s, args.seq), args.seq) / peak \
        if peak else None
    out["wall_s"] = job.t_end - job.t0
    return out


def table(results: dict[str, dict]) -> list[str]:
    from benchmarks.common import table as markdown

    rows = [{**r, "trainer": name, "tokens": r.get("skipped") or ("failed" if "error" in r else
                                                                   r.get("tokens_per_s_per_gpu"))}
            for name, r in results.items()]
    lines = [markdown(rows, [("trainer", "trainer"), ("tokens/s/GPU", "tokens", ",.0f"), ("MFU", "mfu", ".1%"),
                             ("peak GiB", "peak_gib", ".1f"),
                             ("first -> last loss", lambda r: f"{fmt(r.get('first_loss'), '.3f')} -> "
                                                              f"{fmt(r.get('last_loss'), '.3f')}"
                              if "tokens_per_s_per_gpu" in r else "")], markdown=True)]
    native = results["Kiln native"]
    for name in ("HF Trainer", "Kiln hf_class=auto"):
        other = results[name]
        if "tokens_per_s_per_gpu" in native and "tokens_per_s_per_gpu" in other:
            ratio = native["tokens_per_s_per_gpu"] / other["tokens_per_s_per_gpu"]
            lines.append(f"\nKiln native / {name}: **{ratio:.2f}x** tokens/s per GPU")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians (compile, allocator)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ac", default="full", choices=["none", "selective", "full"])
    ap.add_argument("--no-compile", action="store_true", help="Kiln without torch.compile")
    ap.add_argument("--sides", default="native,hf,auto", help="which to run, of native, hf, auto (the auto side takes "
                    "the tokenizer the native side trained into --cache-dir, else trains one)")
    ap.add_argument("--auto-doc-mask", action="store_true", help="the auto side with document masks (each document "
                    "its own sequence), as the native side has them")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "kiln-bench-cache"))
    ap.add_argument("--set", action="append", default=[], help="extra Kiln KEY=VALUE override, both Kiln sides")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="keep the runs (logs, metrics, profiler traces) in this new folder")
    ap.add_argument("--no-append", action="store_true", help=f"do not append to {RESULTS}")
    ap.add_argument("--write-model", default=None, help=argparse.SUPPRESS)  # the auto side's model directory
    args = ap.parse_args()
    if args.write_model:
        a = json.loads(args.write_model)
        write_model(a["shape"], a["seq"], a["tokenizer"], a["out"], a["device"])
        return
    signal.signal(signal.SIGTERM, stop_jobs)
    import torch

    from benchmarks.common import run_info
    from kiln.model.registry import flops_per_token, param_count

    s = SHAPES[args.shape]
    sides = set(args.sides.split(","))
    m = model_config(s, args.seq)
    n = param_count(m)
    card = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    info = run_info(torch.device(args.device), ["transformers", "accelerate"], card=card, nproc=args.nproc,
                    shape=args.shape, seq=args.seq, ac=args.ac, steps=args.steps, params=n,
                    flops_per_token=flops_per_token(m, args.seq))
    print(f"Nemotron-H {args.shape}: {n / 1e9:.2f}B parameters, layers {s['pattern']}", flush=True)
    skipped = {"skipped": "skipped (--sides)"}
    results = {"Kiln native": skipped, "HF Trainer": skipped, "Kiln hf_class=auto": skipped}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        if args.keep and root.exists() and any(root.iterdir()):  # a run left there would be resumed, not measured
            sys.exit(f"--keep {root}: the folder is not empty; name a new one")
        root.mkdir(parents=True, exist_ok=True)
        if "native" in sides:
            results["Kiln native"] = kiln_result(Job(native_command(args, s, root / "kiln"), root / "kiln.log"),
                                                 root / "kiln", args)
            print("kiln native", json.dumps(results["Kiln native"]), flush=True)
        if "hf" in sides:
            hf = run_hf(args, s, root)
            if "error" in hf and args.device == "cpu":  # accelerate's FSDP may refuse the CPU: the smoke test goes on
                hf = {"skipped": "skipped on CPU", "error_tail": hf["error"][-300:]}
            results["HF Trainer"] = hf
            print("hf", json.dumps(hf), flush=True)
        if "auto" in sides:
            results["Kiln hf_class=auto"] = run_auto(args, s, root)
            print("kiln auto", json.dumps(results["Kiln hf_class=auto"]), flush=True)
    for name, r in results.items():
        if "phases" in r:
            print_phases(name, r["phases"])
    lines = [f"\n## {info['date']}: Nemotron-H shape {args.shape} ({n / 1e9:.2f}B parameters, {len(s['pattern'])} "
             f"layers {s['pattern']}), {args.nproc} x {card}, seq {args.seq}, batch 1/GPU, AC {args.ac}, {args.steps} "
             f"steps (median after {args.warmup})", "", *table(results),
             "\nThe HF Trainer and the auto path run transformers' PyTorch Mamba-2 path (mamba-ssm and causal-conv1d "
             "are not installed); Kiln native its own chunked scan, compiled per block. Kiln native keeps the packed "
             "documents apart (attention masks; the convolution and scan restarted at each document); the HF "
             "Trainer trains on random ids without masks, and the auto side "
             + ("with them (each document its own sequence)." if args.auto_doc_mask else "without them.")]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"\n{name} failed: `{r['error'][-400:]!r}`")
    publish("\n".join(lines), RESULTS, not args.no_append, args.json, {**info, **results})
    if "error" in results["Kiln native"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
