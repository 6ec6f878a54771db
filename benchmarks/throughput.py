"""Training throughput of Kiln against the Hugging Face Trainer, same model shape, same tokens, one process.

    python benchmarks/throughput.py --runs 124m:16,1b:8 --hf-trainer --json out.json

For every `size:batch` it trains Kiln's model through Kiln's own `Trainer.train_step` (bf16 autocast,
per-block torch.compile, flash attention, fused AdamW, chunked cross-entropy) and, with
--hf-trainer, `transformers.LlamaForCausalLM` of the same shape under `transformers.Trainer`
(bf16, adamw_torch_fused) on the same random tokens. Each run does a few warm-up steps (compilation
included), then times `--steps` optimizer steps between two device synchronisations. It prints
model, sequence, batch, tokens/s, MFU, peak GiB and Kiln's speed-up last, as a table.

MFU counts 6*N + 12*L*d*T FLOPs per token (kiln.model.registry.flops_per_token) against the
device's dense bf16 peak (989 TFLOP/s on H100/H200).
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # benchmarks/ has scripts named like standard modules (as tokenize.py was): don't shadow them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

import torch  # noqa: E402

from kiln.config import RunConfig  # noqa: E402
from kiln.model.llama import Transformer  # noqa: E402
from kiln.model.registry import flops_per_token  # noqa: E402
from kiln.monitor.meters import peak_flops  # noqa: E402
from kiln.parallel.ac import apply_ac  # noqa: E402
from kiln.parallel.compile import apply_compile, compiled_graph_count  # noqa: E402

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


class RandomTokens:
    """An endless loader of (tokens, targets, doc_ids) with random ids, pinned, like Kiln's PackedLoader."""

    def __init__(self, batch: int, seq: int, vocab: int, docs: int = 0, n: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, vocab, (n, batch, seq + 1), generator=g)
        self.batches = []
        for r in rows:
            doc_ids = None
            if docs:  # `docs` documents of random lengths per row
                cuts = torch.sort(torch.randint(1, seq, (batch, docs - 1), generator=g), dim=1).values
                doc_ids = (torch.arange(seq)[None, None, :] >= cuts[:, :, None]).sum(1).int()
            pin = torch.cuda.is_available()
            self.batches.append(tuple(t.pin_memory() if pin and t is not None else t
                                      for t in (r[:, :-1].contiguous(), r[:, 1:].contiguous(), doc_ids)))
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return self.batches[self.i % len(self.batches)]

    def rows(self):
        """All token rows (for the HF Trainer's dataset)."""
        return torch.cat([b[0] for b in self.batches])


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free():
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _sdpa_backend(name: str):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[name])


def run_kiln(size: str, batch: int, seq: int, warmup: int, steps: int, compile: bool = True, ac: str = "none",
             attention: str = "default", docs: int = 0, name: str = "kiln", scope: str = "blocks",
             precision: str = "bf16", profile: bool = False, data: str = "random", mask: bool = True,
             prefetch: int = 2, mode: str | None = None) -> Result:
    """precision: 'bf16' (autocast over fp32 weights) or 'bf16-params' (bf16 weights and AdamW state).
    data: 'random' tokens, or 'real': Kiln's loader over the corpus of benchmarks/real_run.py
    (prepared with the same settings, so an earlier `real_run.py --prepare-only` is reused), with
    document masking `mask` and `prefetch` batches made ahead in a background thread."""
    from kiln.train.trainer import Trainer

    _free()
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
    fpt = flops_per_token(cfg.model, seq)
    if data == "real":
        loader, val = _real_loaders(cfg, mask, prefetch, device)
    else:
        loader = val = RandomTokens(batch, seq, VOCAB, docs=docs)
    trainer = Trainer(cfg, model, loader, val, device, [], flops_per_token=fpt)
    if mode == "reduce-overhead":  # CUDA graphs: tell the graph trees where each step begins
        step = trainer.train_step
        trainer.train_step = lambda: (torch.compiler.cudagraph_mark_step_begin(), step())[1]
    res = Result(name, size, batch, seq)
    with _sdpa_backend(attention):
        losses = []
        for _ in range(warmup):
            losses.append(trainer.train_step()[0])
        _sync()
        graphs = compiled_graph_count()
        t0 = time.perf_counter()
        for _ in range(steps):
            losses.append(trainer.train_step()[0])
        _sync()
        dt = time.perf_counter() - t0
    res.tokens_per_s = steps * batch * seq / dt
    res.mfu = res.tokens_per_s * fpt / (peak_flops(device) or float("inf"))
    res.peak_gib = _peak_gib()
    res.first_loss, res.last_loss = losses[0].item(), losses[-1].item()
    recompiles = compiled_graph_count() - graphs
    if profile:
        _profile(trainer, attention)
    res.notes = (f"compile={compile} ac={ac} attn={attention} scope={scope} mode={mode} {precision}"
                 + (f" docs={docs}" if docs else ""))
    if data == "real":
        res.notes += f" real data mask={mask} prefetch={prefetch}"
    res.extra = {"recompiles_after_warmup": recompiles, "step_ms": 1000 * dt / steps}
    del trainer, model
    return res


def _real_loaders(cfg: RunConfig, mask: bool, prefetch: int, device: torch.device):
    import importlib.util

    from kiln.config import load_config
    from kiln.data.build import build_data

    spec = importlib.util.spec_from_file_location("real_run", Path(__file__).with_name("real_run.py"))
    real_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_run)
    overrides = real_run.data_overrides(REAL_BYTES, ".kiln-cache")
    overrides += [f"data.document_mask={str(mask).lower()}", f"data.prefetch={prefetch}"]
    data_cfg = load_config(None, overrides).data
    built = build_data(cfg.model_copy(update={"data": data_cfg}), device)
    return built.train, built.val


def _profile(trainer, attention: str, steps: int = 3) -> None:
    """Print the GPU kernels that took the most time over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    with _sdpa_backend(attention), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step()
        _sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))


def run_hf_trainer(size: str, batch: int, seq: int, warmup: int, steps: int) -> Result:
    """transformers.Trainer on LlamaForCausalLM of the same shape: bf16, adamw_torch_fused, as users run it."""
    import tempfile

    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from kiln.config import ModelConfig
    from kiln.model.hf import hf_config

    _free()
    mcfg = ModelConfig(size=size, vocab_size=VOCAB, max_seq_len=max(seq, 2048))
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(mcfg))
    rows = RandomTokens(batch, seq, VOCAB).rows()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            r = rows[i % len(rows)]
            return {"input_ids": r, "labels": r}

    marks: dict[str, float] = {}
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                _sync()
                marks["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == warmup + steps:
                _sync()
                marks["t1"] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=warmup + steps, bf16=True,
            optim="adamw_torch_fused", learning_rate=3e-4, warmup_steps=2, logging_steps=warmup + steps - 1,
            save_strategy="no", report_to="none", disable_tqdm=True, dataloader_pin_memory=True,
            dataloader_num_workers=2, seed=0, use_cpu=not torch.cuda.is_available())
        trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Clock()])
        trainer.train()
    dt = marks["t1"] - marks["t0"]
    res = Result("hf-trainer", size, batch, seq)
    res.tokens_per_s = steps * batch * seq / dt
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res.mfu = res.tokens_per_s * flops_per_token(mcfg, seq) / (peak_flops(dev) or float("inf"))
    res.peak_gib = _peak_gib()
    if losses:
        res.first_loss, res.last_loss = losses[0], losses[-1]
    res.notes = "transformers.Trainer bf16 adamw_torch_fused sdpa"
    res.extra = {"step_ms": 1000 * dt / steps}
    del trainer, model
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
                   help="extra Kiln variant, e.g. 'ac=selective' or 'attention=cudnn,name=kiln-cudnn' (repeatable)")
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
            try:
                results.append(run_kiln(size, batch, a.seq, a.warmup, a.steps, **kw))
            except torch.OutOfMemoryError:
                results.append(Result(kw["name"], size, batch, a.seq, notes="out of memory"))
            except Exception as e:  # noqa: BLE001 (one failing variant must not lose the others' results)
                results.append(Result(kw["name"], size, batch, a.seq, notes=f"failed: {type(e).__name__}: {e}"[:300]))
            print(json.dumps(asdict(results[-1])), flush=True)
        if a.hf_trainer:
            try:
                results.append(run_hf_trainer(size, batch, a.seq, a.warmup, a.steps))
            except torch.OutOfMemoryError:
                results.append(Result("hf-trainer", size, batch, a.seq, notes="out of memory"))
            print(json.dumps(asdict(results[-1])), flush=True)

    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": env, "argv": argv, "results": [asdict(r) for r in results]}, f, indent=1)
    print(f"\n{env}")
    base = {r.size: r.tokens_per_s for r in results if r.name == "hf-trainer" and r.tokens_per_s}
    print(f"{'run':<34} {'model':>5} {'seq':>5} {'batch':>5} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>8} "
          f"{'vs HF':>6} {'loss':>6}")
    for r in results:
        ratio = f"{r.tokens_per_s / base[r.size]:.2f}x" if r.size in base and r.tokens_per_s else "-"
        print(f"{r.name[:34]:<34} {r.size:>5} {r.seq:>5} {r.batch:>5} {r.tokens_per_s:>10,.0f} {r.mfu:>6.1%} "
              f"{r.peak_gib:>8.1f} {ratio:>6} {r.last_loss:>6.3f} {r.notes if not r.tokens_per_s else ''}")
    return results


if __name__ == "__main__":
    main()
