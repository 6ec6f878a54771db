"""Training throughput of Kiln against the Hugging Face Trainer, same model shape, same tokens, one process.

    python benchmarks/throughput.py --runs 124m:16,1b:8 --hf-trainer --json out.json

For every `size:batch` it trains Kiln's model through Kiln's own `Trainer.train_step` (bf16 autocast,
per-block torch.compile, flash attention, fused AdamW, chunked cross-entropy) and, with
--hf-trainer, `transformers.LlamaForCausalLM` of the same shape under `transformers.Trainer`
(bf16, adamw_torch_fused) on the same random tokens (Kiln reads them through its own loader,
benchmarks.synthetic). Each run does a few warm-up steps (compilation
included), then times `--steps` optimizer steps between two device synchronisations. It prints
model, sequence, batch, tokens/s, MFU, peak GiB and Kiln's speed-up last, as a table.

MFU counts 6*N + 12*L*d*T FLOPs per token (kiln.model.registry.flops_per_token) against the
device's dense bf16 peak (989 TFLOP/s on H100/H200).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python benchmarks/throughput.py: import the folder as the package, as python -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.common import free, hf_rows, hf_step_clock, peak_gib, run_info, sync, table, write_json
from benchmarks.synthetic import random_loader
from kiln.config import RunConfig
from kiln.model.llama import Transformer
from kiln.model.registry import flops_per_token
from kiln.monitor.meters import peak_flops
from kiln.parallel import loss_kernel
from kiln.parallel.ac import apply_ac
from kiln.parallel.compile import apply_compile, compiled_graph_count

VOCAB = 32000
REAL_BYTES = 400_000_000  # the corpus of benchmarks/real_run.py


@dataclass
class Result:
    name: str
    size: str
    batch: int
    seq: int
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_gib: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    notes: str = ""
    extra: dict = field(default_factory=dict)


def _sdpa_backend(name: str):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[name])


def run_kiln(size: str, batch: int, seq: int, warmup: int, steps: int, compile: bool = True, ac: str = "none",
             attention: str = "default", docs: int = 0, name: str = "kiln", scope: str = "blocks",
             precision: str = "bf16", profile: bool = False, data: str = "random", mask: bool = True,
             prefetch: int = 2, mode: str | None = None, ce: str = "auto") -> Result:
    """precision: 'bf16' (autocast over fp32 weights) or 'bf16-params' (bf16 weights and AdamW state).
    data: 'random' tokens (in rows of `docs` documents on average, with document masking; 0: one causal
    row), or 'real' ones; either way through Kiln's loader (benchmarks.synthetic) with `prefetch` batches
    made ahead in a background thread. 'real' reads over the corpus of benchmarks/real_run.py
    (prepared with the same settings, so an earlier `real_run.py --prepare-only` is reused), with
    document masking `mask`. ce: the cross-entropy's kernel, as train.cross_entropy_kernel (auto, triton, torch)."""
    from kiln.train.trainer import Trainer

    free()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = RunConfig.model_validate({
        "model": {"size": size, "vocab_size": VOCAB, "max_seq_len": max(seq, 2048)},
        "train": {"batch_size": batch, "seq_len": seq, "max_steps": warmup + steps, "warmup_steps": 2,
                  "lr": 3e-4, "precision": "bf16" if precision == "bf16" else "fp32", "compile": compile,
                  "activation_checkpointing": ac},
        "logging": {"console": False, "jsonl": False},
    })
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    if precision == "bf16-params":
        model.to(torch.bfloat16)
    apply_ac(model, ac)
    if compile:
        apply_compile(model, scope=scope, mode=mode)
    ce = loss_kernel.install(ce, device, log=lambda s: None)  # process-wide: each variant installs its own
    fpt = flops_per_token(cfg.model, seq)
    with tempfile.TemporaryDirectory() as tmp:
        if data == "real":
            loader = _real_loader(cfg, mask, prefetch, device)
        else:
            loader = random_loader(tmp, batch, seq, VOCAB, docs_per_row=docs, prefetch=prefetch)
        try:
            trainer = Trainer(cfg, model, loader, None, device, [], flops_per_token=fpt)
            res = _time_kiln(Result(name, size, batch, seq), trainer, fpt, warmup, steps, attention, mode, profile)
        finally:
            loader.close()
    res.notes = (f"compile={compile} ac={ac} attn={attention} scope={scope} mode={mode} {precision} ce={ce}"
                 + (f" docs={docs}" if docs else ""))
    if data == "real":
        res.notes += f" real data mask={mask} prefetch={prefetch}"
    return res


def _time_kiln(res: Result, trainer, fpt: float, warmup: int, steps: int, attention: str, mode: str | None,
               profile: bool) -> Result:
    """`res` measured: `warmup` steps of Kiln's Trainer, then `steps` timed between two device synchronisations."""
    if mode == "reduce-overhead":  # CUDA graphs: tell the graph trees where each step begins
        step = trainer.train_step
        trainer.train_step = lambda: (torch.compiler.cudagraph_mark_step_begin(), step())[1]
    with _sdpa_backend(attention):
        losses = []
        for _ in range(warmup):
            losses.append(trainer.train_step()[0])
        sync()
        graphs = compiled_graph_count()
        t0 = time.perf_counter()
        for _ in range(steps):
            losses.append(trainer.train_step()[0])
        sync()
        dt = time.perf_counter() - t0
    res.tokens_per_s = steps * trainer.tokens_per_step / dt
    res.mfu = res.tokens_per_s * fpt / (peak_flops(trainer.device) or float("inf"))
    res.peak_gib = peak_gib()
    res.first_loss, res.last_loss = losses[0].item(), losses[-1].item()
    recompiles = compiled_graph_count() - graphs
    if profile:
        _profile(trainer, attention)
    res.extra = {"recompiles_after_warmup": recompiles, "step_ms": 1000 * dt / steps}
    return res


def _real_loader(cfg: RunConfig, mask: bool, prefetch: int, device: torch.device):
    """Kiln's loader over the corpus of benchmarks/real_run.py (prepared there, or here the first time)."""
    from benchmarks.real_run import data_overrides
    from kiln.config import load_config
    from kiln.data.build import build_data

    overrides = data_overrides(REAL_BYTES, ".kiln-cache")
    overrides += [f"data.document_mask={str(mask).lower()}", f"data.prefetch={prefetch}"]
    data_cfg = load_config(None, overrides).data
    return build_data(cfg.model_copy(update={"data": data_cfg}), device).train


def _profile(trainer, attention: str, steps: int = 3) -> None:
    """Print the GPU kernels that took the most time over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    with _sdpa_backend(attention), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step()
        sync()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90))


def run_hf_trainer(size: str, batch: int, seq: int, warmup: int, steps: int, name: str = "hf-trainer") -> Result:
    """transformers.Trainer on LlamaForCausalLM of the same shape: bf16, adamw_torch_fused, as users run it, on
    rows of the same random tokens."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from kiln.config import ModelConfig
    from kiln.model.hf import hf_config

    free()
    mcfg = ModelConfig(size=size, vocab_size=VOCAB, max_seq_len=max(seq, 2048))
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(mcfg))
    with tempfile.TemporaryDirectory() as tmp:
        loader = random_loader(tmp, batch, seq, VOCAB, prefetch=0)
        rows = torch.cat([next(loader)[0] for _ in range(8)])
    clock = hf_step_clock(warmup, warmup + steps)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=warmup + steps, bf16=True,
            optim="adamw_torch_fused", learning_rate=3e-4, warmup_steps=2, logging_steps=warmup + steps - 1,
            save_strategy="no", report_to="none", disable_tqdm=True, dataloader_pin_memory=True,
            dataloader_num_workers=2, seed=0, use_cpu=not torch.cuda.is_available())
        Trainer(model=model, args=args, train_dataset=hf_rows(rows), callbacks=[clock]).train()
    res = Result(name, size, batch, seq)
    res.tokens_per_s = steps * batch * seq / clock.seconds
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res.mfu = res.tokens_per_s * flops_per_token(mcfg, seq) / (peak_flops(dev) or float("inf"))
    res.peak_gib = peak_gib()
    if clock.losses:
        res.first_loss, res.last_loss = clock.losses[0], clock.losses[-1]
    res.notes = "transformers.Trainer bf16 adamw_torch_fused sdpa"
    res.extra = {"step_ms": 1000 * clock.seconds / steps}
    return res


def _parse_variant(text: str) -> dict:
    """'compile=0,ac=selective,attention=cudnn,docs=8,name=x' -> kwargs of run_kiln."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        flag = lambda s: s not in ("0", "false")  # noqa: E731
        out[k] = {"compile": flag, "profile": flag, "mask": flag, "docs": int, "prefetch": int}.get(k, str)(v)
    return out


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="124m:16", help="comma-separated size:batch pairs")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--variant", action="append", default=[],
                   help="extra Kiln variant, e.g. 'ac=selective', 'attention=cudnn,name=kiln-cudnn' or 'ce=torch' "
                   "(train.cross_entropy_kernel; repeatable)")
    p.add_argument("--hf-trainer", action="store_true", help="also run the HF Trainer baseline of each size")
    p.add_argument("--no-default", action="store_true", help="run only the --variant runs, not the default one")
    p.add_argument("--json", help="write every result here as JSON")
    a = p.parse_args(argv)

    results: list[Result] = []
    for run in a.runs.split(","):
        size, _, b = run.partition(":")
        batch = int(b or 8)
        for variant in ([] if a.no_default else [""]) + a.variant:
            kw = _parse_variant(variant)
            kw.setdefault("name", "kiln" + (f"[{variant}]" if variant else ""))
            results.append(_measure(run_kiln, size, batch, a.seq, a.warmup, a.steps, **kw))
        if a.hf_trainer:
            results.append(_measure(run_hf_trainer, size, batch, a.seq, a.warmup, a.steps, name="hf-trainer"))

    env = run_info(packages=["transformers"])
    write_json(a.json, {"env": env, "argv": argv, "results": [asdict(r) for r in results]})
    print(f"\n{env}")
    base = {r.size: r.tokens_per_s for r in results if r.name == "hf-trainer" and r.tokens_per_s}
    print(table([asdict(r) for r in results], [
        ("run", lambda r: r["name"][:34]), ("model", "size"), ("seq", "seq"), ("batch", "batch"),
        ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"), ("peak GiB", "peak_gib", ".1f"),
        ("vs HF", lambda r: r["tokens_per_s"] / base[r["size"]] if r["size"] in base and r["tokens_per_s"] else None,
         "{:.2f}x"),
        ("loss", "last_loss", ".3f"), ("notes", lambda r: "" if r["tokens_per_s"] else r["notes"])]))
    failed = [r.name for r in results if r.notes.startswith("failed")]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
    return results


def _measure(run, size: str, batch: int, seq: int, warmup: int, steps: int, name: str, **kw) -> Result:
    """`run`'s result, or one that says why it has none: one failing run must not lose the others' results."""
    try:
        res = run(size, batch, seq, warmup, steps, name=name, **kw)
    except torch.OutOfMemoryError:
        res = Result(name, size, batch, seq, notes="out of memory")
    except Exception as e:  # noqa: BLE001 (reported in the table, and the script's exit status)
        res = Result(name, size, batch, seq, notes=f"failed: {type(e).__name__}: {e}"[:300])
    print(json.dumps(asdict(res)), flush=True)
    return res


if __name__ == "__main__":
    main()
