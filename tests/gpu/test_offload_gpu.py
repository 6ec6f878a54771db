"""train.offload=optimizer on a real GPU: gradients leave through pinned buffers on a side stream, AdamW steps on the
host and the weights come back; the losses are the plain path's, and a run whose fp32 state would not fit under a
memory cap trains under it."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kiln.config import load_config
from kiln.events import Callback
from kiln.train.run import run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("offload-gpu")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:40])
    (root / "corpus").mkdir()
    for i in range(60):
        (root / "corpus" / f"{i:03d}.txt").write_text(text[i * 4000:(i + 1) * 4000])
    return root


def args(root: Path, name: str, *extra: str) -> list[str]:
    return ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "train.seq_len=128", "train.batch_size=2",
            "train.grad_accum=3", "train.max_steps=12", "train.warmup_steps=2", "train.grad_clip=0.5",
            "train.lr=1e-3", "train.eval_every=0", "train.sample_tokens=0", "train.device=cuda", "logging.every=1",
            "logging.console=false", "logging.plots=false", "checkpoint.every=0", "checkpoint.save_final=false",
            f"data.sources=[{root / 'corpus'}]", "data.vocab_size=512", f"data.cache_dir={root / 'cache'}",
            f"train.run_dir={root / name}", *extra]


def losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["event"] == "train"]


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_offload_trains_as_the_plain_path_on_the_gpu(corpus, precision, tol):
    """fp32: the same gradients and sums, AdamW's CUDA and CPU kernels; bf16: the weights the GPU computes with are
    the masters rounded to bf16 on both paths (autocast's casts, or the copies sent back)."""
    out = {}
    for mode in ("none", "optimizer"):
        name = f"{precision}-{mode}"
        run(load_config(None, args(corpus, name, f"train.precision={precision}", f"train.offload={mode}")),
            console=Console(quiet=True))
        out[mode] = losses(corpus / name)
    assert len(out["none"]) == 12 and out["optimizer"][-1] < out["optimizer"][0] - 0.5  # it learns
    assert out["optimizer"] == pytest.approx(out["none"], rel=tol)


class Peak(Callback):
    def __init__(self):
        self.peak, self.pinned = 0, None

    def on_train_start(self, trainer):
        o = trainer.offload  # page-locked sums and masters: the copies both ways are asynchronous
        self.pinned = o.sums[0].is_pinned() and o.masters[0].is_pinned()

    def on_step_end(self, trainer, metrics):
        self.peak = max(self.peak, torch.cuda.max_memory_allocated())


def test_a_run_capped_below_its_plain_fp32_state_trains_under_the_cap(corpus):
    """A 170M-parameter model: AdamW's fp32 state alone (16 bytes a parameter: 2.7 GB) is over the 1.5 GiB cap; the
    offloaded preset's settings (bf16 weights, full activation checkpointing, compile) train under it."""
    cap = int(1.5 * 2**30)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    peak = Peak()
    try:
        cfg = load_config("cpt-8b-24gb", [*args(corpus, "capped"), "model.init_from=null", "model.d_model=1024",
                                          "model.n_layers=8", "model.n_heads=8", "model.vocab_size=32000",
                                          "train.seq_len=1024", "train.batch_size=1", "train.grad_accum=4",
                                          "train.max_steps=4", "train.lr=1e-4"])
        run(cfg, console=Console(quiet=True), callbacks=[peak])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    from kiln.model.registry import param_count

    assert 16 * param_count(cfg.model) > 1.7 * 2**30
    assert len(losses(corpus / "capped")) == 4 and peak.pinned
    assert 0 < peak.peak <= cap and torch.cuda.max_memory_allocated() <= cap
