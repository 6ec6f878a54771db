"""A Qwen3-MoE-shaped mixture of experts with FSDP2 on N GPUs: Kiln beside the Hugging Face Trainer, in one call.

    python benchmarks/moe.py --nproc 4                                  # the 4-GPU measurement (20 layers, below)
    python benchmarks/moe.py --nproc 1 --shape small --seq 2048          # one GPU, a small MoE
    python benchmarks/moe.py --shape tiny --device cpu --nproc 1 --steps 3 --seq 32   # a smoke test
    python benchmarks/moe.py --nproc 4 --skip-hf --variant dist.expert_parallel=4   # expert parallelism beside FSDP

Shapes (per layer as Qwen3-30B-A3B: d 2048, 32 query / 4 key-value heads of 128 with q/k norms, 128 experts of
hidden 768, top 8 renormalised, vocab 151936, untied):
    30b-a3b  --layers 20 by default: 13.1B parameters, 1.5B active per token. The whole 48 layers (30.5B) do not
             fit 4 x 80 GB with fp32 weights, gradients and AdamW moments (16 bytes a parameter: 490 GB), on either
             side; 20 layers take 52 GB a GPU of them, beside the gathered layers and the activations.
    small    d 512, 8 layers, 16 experts of 256, top 4, vocab 32000 (one GPU).
    tiny     d 64, 2 layers, 4 experts, top 2 (the CPU smoke test).

(a) Kiln: `kiln train --nproc N`, the native model with model.moe (router, stacked experts, grouped GEMMs), the
    load-balancing loss (coefficient 0.001) in the objective, dist.strategy=fsdp (each block sharded, its
    experts with it), batch 1 per GPU, bf16, compile per block (GPU), activation checkpointing --ac, random init,
    on the standard library corpus (tokenized once into --cache-dir).
(b) The Hugging Face Trainer: Qwen3MoeForCausalLM of the same config (transformers' default experts
    implementation, grouped_mm where it dispatches; output_router_logits on, so it trains on the same
    load-balancing term), random init, bf16, fused AdamW, batch 1 per GPU, FSDP2 through accelerate wrapping each
    Qwen3MoeDecoderLayer, its own activation checkpointing; random token ids; steps timed by a callback.

(c) --variant KEY=VALUE[;KEY=VALUE...] (repeatable): another Kiln job, (a) with these overrides, a row of its own and
    its speed over (a)'s: `dist.expert_parallel=4` keeps 32 whole experts on each of 4 GPUs and sends the tokens to
    them (kiln.parallel.experts) where (a) gathers all 128 experts of each layer on every GPU.

Gradient reduction: Kiln runs its default, reduce-scatter in fp32 (dist.reduce_fp32=true, exact sums), while
accelerate's FSDP2 reduces in bf16 (the table says which each side used: twice the traffic on Kiln's side). The
like-for-like bf16 variant is `--set dist.reduce_fp32=false`. Step time: Kiln's is the wall time between two
logging reads (logging.every=1), data, logging and its one host read of each step included; the HF Trainer's
callback times from step begin to step end between device synchronisations, its batch fetch and logging left out.

tokens/s per GPU and MFU are medians over the steps after --warmup; both MFUs count the active parameters (the
router and the top-k experts: kiln.model.registry.flops_per_token) and the card's peak. Peak memory is
torch.cuda.max_memory_allocated from the first training step on. The table is printed and appended, dated and
with the card's name, to benchmarks/results/moe.md; --json writes the numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/moe.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import signal
import tempfile
import time

from benchmarks import hf_worker
from benchmarks.fsdp_8b import Job, fmt, kiln_phases, peak_flops, print_phases, publish, speed, stop_jobs, train_records

RESULTS = Path(__file__).parent / "results" / "moe.md"

SHAPES = {  # d, layers, heads, kv heads, head dim, experts, top k, expert hidden, vocab
    "30b-a3b": dict(d=2048, layers=48, heads=32, kv=4, head=128, experts=128, top_k=8, hidden=768, vocab=151936),
    "small": dict(d=512, layers=8, heads=8, kv=2, head=64, experts=16, top_k=4, hidden=256, vocab=32000),
    "tiny": dict(d=64, layers=2, heads=4, kv=2, head=16, experts=4, top_k=2, hidden=32, vocab=512),
}
DEFAULT_LAYERS = {"30b-a3b": 20}


def shape_of(args) -> dict:
    s = dict(SHAPES[args.shape])
    s["layers"] = args.layers or DEFAULT_LAYERS.get(args.shape, s["layers"])
    return s


def model_config(s: dict, seq: int):
    """Kiln's ModelConfig of shape `s` (what flops_per_token and the parameter counts read)."""
    from kiln.config import ModelConfig, MoEConfig

    return ModelConfig(vocab_size=s["vocab"], d_model=s["d"], n_layers=s["layers"], n_heads=s["heads"],
                       n_kv_heads=s["kv"], head_size=s["head"], qk_norm=True, tie_embeddings=False,
                       max_seq_len=max(seq, 64), rope_theta=1e6, norm_eps=1e-6,
                       moe=MoEConfig(n_experts=s["experts"], top_k=s["top_k"], expert_hidden=s["hidden"]))


def kiln_command(args, s: dict, run_dir: Path, variant: tuple[str, ...] = ()) -> list[str]:
    cuda = args.device == "cuda"
    return [sys.executable, "-m", "kiln.cli", "train", f"model.vocab_size={s['vocab']}", f"model.d_model={s['d']}",
            f"model.n_layers={s['layers']}", f"model.n_heads={s['heads']}", f"model.n_kv_heads={s['kv']}",
            f"model.head_size={s['head']}", "model.qk_norm=true", "model.tie_embeddings=false",
            "model.rope_theta=1000000", "model.norm_eps=1e-6", f"model.max_seq_len={max(args.seq, 64)}",
            f"model.moe.n_experts={s['experts']}", f"model.moe.top_k={s['top_k']}",
            f"model.moe.expert_hidden={s['hidden']}", "model.moe.norm_topk=true", "model.moe.aux_loss_coef=0.001",
            f"train.seq_len={args.seq}", "train.batch_size=1", "train.grad_accum=1", f"train.max_steps={args.steps}",
            f"train.device={args.device}", f"train.precision={'bf16' if cuda else 'fp32'}",
            f"train.compile={str(cuda and not args.no_compile).lower()}", f"train.activation_checkpointing={args.ac}",
            "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0", "train.warmup_steps=2",
            f"train.lr={hf_worker.LR}",
            "logging.every=1", "logging.plots=false", "logging.console=false", "checkpoint.save_final=false",
            "checkpoint.at_end=false", "checkpoint.every=0", "dist.strategy=fsdp", "dist.sharding=full",
            f"data.vocab_size={min(s['vocab'], 32000)}", f"data.cache_dir={args.cache_dir}",
            f"data.max_bytes={args.data_bytes}",
            f"train.run_dir={run_dir}", *args.set, *variant, "--nproc", str(args.nproc)]


def run_kiln(args, s: dict, root: Path, variant: tuple[str, ...] = (), name: str = "kiln") -> dict:
    """Kiln's job (with a variant's overrides); where it fails compiled, once more without compile (the row says
    so), so that one call on the GPUs still measures the model."""
    out = _kiln_job(args, s, root, name, variant)
    if "error" in out and args.device == "cuda" and not args.no_compile:
        print(f"kiln failed compiled; again without compile:\n{out['error'][-1500:]}", flush=True)
        no_compile, args.no_compile = args.no_compile, True
        out = {**_kiln_job(args, s, root, f"{name}-eager", variant), "compile_failed": out["error"][-1500:]}
        args.no_compile = no_compile
    return out


def _kiln_job(args, s: dict, root: Path, name: str, variant: tuple[str, ...] = ()) -> dict:
    run_dir = root / name
    job = Job(kiln_command(args, s, run_dir, variant), root / f"{name}.log")
    code = job.wait()
    recs = {r["step"]: r for r in train_records(run_dir)}
    if max(recs, default=0) < args.steps:
        return {"error": f"kiln train failed ({code}):\n{job.text(3000)}"}
    late = [st for st in recs if st > args.warmup] or list(recs)
    return {**speed(recs, late),
            "aux_loss": [recs[st].get("aux_loss") for st in sorted(recs)],
            "wall_s": job.t_end - job.t0, "exit_code": code, "phases": kiln_phases(job, recs),
            "reduce_dtype": kiln_reduce_dtype(args),
            "alloc_retries": sum(recs[st].get("alloc_retries") or 0 for st in late),
            "experts_loop": experts_loop(job)}


def kiln_reduce_dtype(args) -> str:
    """The dtype Kiln's FSDP2 reduces gradients in: float32 unless a --set turns dist.reduce_fp32 off (bf16 runs)."""
    off = any(x.replace(" ", "").lower() in ("dist.reduce_fp32=false", "dist.reduce_fp32=0") for x in args.set)
    return "float32" if args.device != "cuda" or not off else "bfloat16"


def experts_loop(job: Job) -> list[str]:
    """Why Kiln's experts ran as a loop over their rows on a GPU, not torch's grouped GEMM, as its warnings say
    (kiln.model.grouped_mm.ExpertsKernelWarning; each rank says it once): empty where the kernel ran."""
    mark = "ExpertsKernelWarning: "
    return sorted({line.split(mark, 1)[1] for _, line in job.lines if mark in line})


def run_hf(args, s: dict, root: Path) -> dict:
    config = dict(vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=4 * s["d"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                  head_dim=s["head"], num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                  moe_intermediate_size=s["hidden"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  max_position_embeddings=args.seq, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  output_router_logits=True, router_aux_loss_coef=0.001, use_cache=False)  # the load-balancing term
    spec = {"model": "Qwen3MoeForCausalLM", "config_class": "Qwen3MoeConfig", "config": config,
            "layer": "Qwen3MoeDecoderLayer", "tokens": s["vocab"], "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "ac": args.ac, "device": args.device, "out": str(root / "hf"),
            "report": ["experts_implementation", "reduce_dtype"], "t0": time.time()}
    job = Job(hf_worker.command(spec, args.nproc), root / "hf.log", env=hf_worker.env())
    code = job.wait()
    out = hf_worker.parse(x for _, x in job.lines)
    if code != 0 or out is None:
        return {"error": job.text(1500)}
    from kiln.model.registry import flops_per_token

    peak = peak_flops(args.device)
    fpt = flops_per_token(model_config(s, args.seq), args.seq)
    out["mfu"] = out["tokens_per_s_per_gpu"] * fpt / peak if peak else None
    out["wall_s"] = job.t_end - job.t0
    return out


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def table(kiln: dict, hf: dict, variants: dict[str, dict] | None = None) -> list[str]:
    from benchmarks.common import table as markdown

    variants = variants or {}
    named = [("Kiln (native MoE)" + (", not compiled" if "compile_failed" in kiln else ""), kiln),
             ("HF Trainer", hf),
             *((f"Kiln, `{v}`" + (", not compiled" if "compile_failed" in r else ""), r) for v, r in variants.items())]
    rows = [{**r, "trainer": name, "tokens": r.get("skipped") or ("failed" if "error" in r else
                                                                   r.get("tokens_per_s_per_gpu"))}
            for name, r in named]
    lines = [markdown(rows, [("trainer", "trainer"), ("tokens/s/GPU", "tokens", ",.0f"), ("MFU (active)", "mfu", ".1%"),
                             ("peak GiB", "peak_gib", ".1f"),
                             ("first -> last loss", lambda r: f"{fmt(r.get('first_loss'), '.3f')} -> "
                                                              f"{fmt(r.get('last_loss'), '.3f')}"
                              if "tokens_per_s_per_gpu" in r else "")], markdown=True)]
    if "tokens_per_s_per_gpu" in hf and "tokens_per_s_per_gpu" in kiln:
        lines.append(f"\nKiln / HF Trainer: **{kiln['tokens_per_s_per_gpu'] / hf['tokens_per_s_per_gpu']:.2f}x** "
                     "tokens/s per GPU")
    for v, r in variants.items():  # each variant against the first Kiln job (and the HF Trainer where it ran)
        if "tokens_per_s_per_gpu" in r and "tokens_per_s_per_gpu" in kiln:
            lines.append(f"\nKiln, `{v}` / Kiln: **{r['tokens_per_s_per_gpu'] / kiln['tokens_per_s_per_gpu']:.2f}x** "
                         f"tokens/s per GPU, peak memory {fmt(r.get('peak_gib'), '.1f')} against "
                         f"{fmt(kiln.get('peak_gib'), '.1f')} GiB")
        if "tokens_per_s_per_gpu" in r and "tokens_per_s_per_gpu" in hf:
            ratio = r["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"]
            lines.append(f"\nKiln, `{v}` / HF Trainer: **{ratio:.2f}x** tokens/s per GPU")
        for why in r.get("experts_loop") or []:
            lines.append(f"\nKiln, `{v}`: its experts did not run torch's grouped GEMM: `{why}`")
    for why in kiln.get("experts_loop") or []:
        lines.append(f"\nKiln's experts did not run torch's grouped GEMM: `{why}`")
    if kiln.get("alloc_retries"):
        lines.append(f"\nKiln's CUDA allocator retried {kiln['alloc_retries']:.0f} allocations a GPU (the mean over "
                     "GPUs) in the measured steps: each freed its cache and waited for the GPU")
    if hf.get("reduce_dtype") and kiln.get("reduce_dtype"):
        lines.append(f"\nGradients reduced in {kiln['reduce_dtype']} by Kiln (dist.reduce_fp32), in "
                     f"{hf['reduce_dtype']} by the HF Trainer (accelerate's FSDP2 mixed precision)")
    if hf.get("experts_implementation"):
        lines.append(f"\nThe HF Trainer's experts ran transformers' `{hf['experts_implementation']}` implementation")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="layers of the shape (0: 20 for 30b-a3b, else its own)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (compile, allocator)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--ac", default="full", choices=["none", "selective", "full"])
    ap.add_argument("--no-compile", action="store_true", help="Kiln without torch.compile")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "kiln-bench-cache"))
    ap.add_argument("--data-bytes", type=int, default=4_000_000, help="bytes of the standard library corpus Kiln "
                    "tokenizes (about a million tokens: more than the steps read)")
    ap.add_argument("--set", action="append", default=[], help="extra Kiln KEY=VALUE override (repeatable)")
    ap.add_argument("--variant", action="append", default=[], help="another Kiln job with these overrides (KEY=VALUE, "
                    "';' between several; e.g. dist.expert_parallel=4), a row of its own and its ratio to the first "
                    "Kiln job (repeatable)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="keep the runs (logs, metrics, profiler traces) in this new folder")
    ap.add_argument("--no-append", action="store_true", help=f"do not append to {RESULTS}")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, stop_jobs)
    import torch

    from benchmarks.common import run_info
    from kiln.model.registry import active_param_count, param_count

    s = shape_of(args)
    m = model_config(s, args.seq)
    total, active = param_count(m), active_param_count(m)
    card = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    info = run_info(torch.device(args.device), ["transformers", "accelerate"], card=card, nproc=args.nproc,
                    shape=args.shape, layers=s["layers"], seq=args.seq, ac=args.ac, steps=args.steps,
                    params=total, active_params=active)
    print(f"{args.shape}, {s['layers']} layers: {count(total)} parameters, {count(active)} active per token",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        if args.keep and root.exists() and any(root.iterdir()):  # a run left there would be resumed, not measured
            sys.exit(f"--keep {root}: the folder is not empty; name a new one")
        root.mkdir(parents=True, exist_ok=True)
        kiln = run_kiln(args, s, root)
        print("kiln", json.dumps(kiln), flush=True)
        if "phases" in kiln:
            print_phases("kiln", kiln["phases"])
        hf = {"skipped": "skipped (--skip-hf)"} if args.skip_hf else run_hf(args, s, root)
        if "error" in hf and args.device == "cpu":  # accelerate's FSDP may refuse the CPU: the smoke test goes on
            hf = {"skipped": "skipped on CPU", "error_tail": hf["error"][-300:]}
        print("hf", json.dumps(hf), flush=True)
        if "phases" in hf:
            print_phases("HF Trainer", hf["phases"])
        variants = {}
        for i, v in enumerate(args.variant):  # the compile cache is warm now
            variants[v] = run_kiln(args, s, root, tuple(o.strip() for o in v.split(";") if o.strip()), f"variant{i}")
            print("kiln variant", v, json.dumps(variants[v]), flush=True)
            if "phases" in variants[v]:
                print_phases(f"kiln {v}", variants[v]["phases"])
    lines = [f"\n## {info['date']}: Qwen3-MoE shape {args.shape}, {s['layers']} layers ({count(total)} parameters, "
             f"{count(active)} active: {s['experts']} experts, top {s['top_k']}), {args.nproc} x {card}, "
             f"seq {args.seq}, batch 1/GPU, AC {args.ac}, {args.steps} steps (median after {args.warmup})", "",
             *table(kiln, hf, variants)]
    if "compile_failed" in kiln:
        lines.append(f"\nKiln compiled failed, so its row ran without compile: `{kiln['compile_failed'][-400:]!r}`")
    for name, r in (("Kiln", kiln), ("HF Trainer", hf), *((f"Kiln, `{v}`", r) for v, r in variants.items())):
        if "error" in r:
            lines.append(f"\n{name} failed: `{r['error'][-400:]!r}`")
    publish("\n".join(lines), RESULTS, not args.no_append, args.json,
            {**info, "kiln": kiln, "hf": hf, "variants": variants})
    if "error" in kiln:
        sys.exit(1)


if __name__ == "__main__":
    main()
