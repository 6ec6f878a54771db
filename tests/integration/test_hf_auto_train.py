"""model.hf_class=auto end to end on the CPU: a transformers model (GPT-2, Llama layout through
AutoModelForCausalLM) trains in Kiln's loop, resumes exactly after a crash, and its final model and
checkpoints export to directories transformers (and PEFT, for LoRA) load with equal logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.model.generate import generate
from kiln.state.export import export_from
from kiln.state.weights import load_model
from kiln.train.events import Callback
from kiln.train.run import run

from .hf_dirs import tokenizer, write_corpus, write_hf_dir

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hfauto")
    tok = tokenizer()
    for kind in ("gpt2", "llama"):
        write_hf_dir(root / kind, kind, tok=tok)
    write_corpus(root / "corpus", 12)
    return root


def overrides(root: Path, kind: str, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.init_from={root / kind}", "model.hf_class=auto", f"data.sources=[{root / 'corpus'}]",
            f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.25", "data.workers=1", "train.seq_len=32",
            "train.batch_size=4", "train.max_steps=12", "train.eval_every=0", "train.eval_batches=2",
            "train.warmup_steps=2", "train.lr=3e-3", "train.device=cpu", "train.precision=fp32",
            "train.sample_tokens=0", f"train.run_dir={run_dir}", "checkpoint.every=6", "checkpoint.async_save=false",
            "logging.console=false", "logging.plots=false", "logging.every=1", *extra]


def step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


class Evals(Callback):
    def __init__(self):
        self.losses = []

    def on_eval_end(self, trainer, metrics):
        self.losses.append(metrics["val_loss"])


def logits_of(path: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def test_train_export_and_generate(root, tmp_path):
    evals = Evals()
    run_dir = run(load_config(None, overrides(root, "gpt2", tmp_path / "run")), callbacks=[evals])
    assert len(evals.losses) == 2 and evals.losses[-1] < evals.losses[0] - 0.05  # it learns
    model, tok = load_model(run_dir)
    assert type(model.base).__name__ == "GPT2LMHeadModel" and tok is not None
    x = torch.tensor([tok.encode("def main(argv):\n    return 0\n")[:24]])
    with torch.no_grad():
        want = model(x)
    start = logits_of(root / "gpt2", x)
    assert not torch.allclose(start, want, atol=1e-3)  # the weights trained
    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    for src in (run_dir, run_dir / "model", ckpt):
        out = export_from(src, tmp_path / f"export-{src.name}")
        torch.testing.assert_close(logits_of(out, x), want, atol=1e-5, rtol=1e-5)
        assert transformers.AutoTokenizer.from_pretrained(out).encode("def main(") == tok.encode("def main(")
    bf16 = export_from(run_dir, tmp_path / "bf16", dtype="bf16")
    assert transformers.AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16
    ids = generate(model, tok.encode("def "), 6, temperature=0, vocab_size=tok.vocab_size)
    assert len(ids) == 6


class Crash(Callback):
    def on_step_end(self, trainer, metrics):
        if trainer.step == 8:
            raise RuntimeError("injected failure")


def test_resume_after_a_crash_equals_the_uninterrupted_run(root, tmp_path):
    whole = run(load_config(None, overrides(root, "llama", tmp_path / "whole")))
    args = overrides(root, "llama", tmp_path / "crashed")
    with pytest.raises(RuntimeError, match="injected failure"):
        run(load_config(None, args), callbacks=[Crash()])
    assert max(step_losses(tmp_path / "crashed")) == 8
    run(load_config(None, args))  # resumes from step 6
    want, got = step_losses(whole), step_losses(tmp_path / "crashed")
    assert sorted(want) == list(range(1, 13))
    for step in range(7, 13):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), step


class OptimizerParams(Callback):
    def on_train_start(self, trainer):
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        self.names = [names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]
        self.trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("base_dtype", ["fp32", "bf16"])
def test_peft_lora_trains_adapters_and_exports_them(root, tmp_path, base_dtype):
    """The final model/ and the last checkpoint export one model: the adapters on the base as stored (fp32), also
    when it trained in bf16 (lora.base_dtype), as PEFT computes it in fp32."""
    peft = pytest.importorskip("peft")
    seen = OptimizerParams()
    run_dir = run(load_config(None, overrides(root, "llama", tmp_path / "run", "lora.rank=4", "lora.alpha=8",
                                              "lora.targets=[q,v]", f"lora.base_dtype={base_dtype}",
                                              "train.lr=1e-2")),
                  callbacks=[seen])
    assert seen.names and sorted(seen.names) == sorted(seen.trainable)
    assert all(".lora_A." in n or ".lora_B." in n for n in seen.names)
    x = torch.randint(0, 300, (1, 20))
    merged = logits_of(run_dir / "model", x)  # the adapters merged into the base
    assert not torch.allclose(logits_of(root / "llama", x), merged, atol=1e-4)  # the adapters trained
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, run_dir / "model" / "adapters").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=x).logits, merged, atol=1e-5, rtol=1e-5)
    model, _ = load_model(run_dir)
    with torch.no_grad():
        torch.testing.assert_close(model(x), merged)
    out = export_from(sorted((run_dir / "checkpoints").iterdir())[-1], tmp_path / "from-ckpt")
    torch.testing.assert_close(logits_of(out, x), merged, atol=1e-5, rtol=1e-5)


def kiln_train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kiln.cli", "train", *args] + (["--nproc", str(nproc)] if nproc > 1 else [])
    env = {**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("strategy", ["fsdp"])
def test_two_processes_train_the_losses_of_one(root, tmp_path, strategy):
    """FSDP2 shards each decoder block of the transformers model (found generically), with activation
    checkpointing; the losses and final weights are the one-process run's with the same global batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    run(load_config(None, overrides(root, "llama", one, "train.activation_checkpointing=full")))  # in this process
    args = overrides(root, "llama", two, "train.batch_size=2", f"dist.strategy={strategy}",
                     "train.activation_checkpointing=full")
    kiln_train(*args, nproc=2)
    want, got = step_losses(one), step_losses(two)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-4), step
    x = torch.randint(0, 300, (1, 16))
    torch.testing.assert_close(logits_of(two / "model", x), logits_of(one / "model", x), atol=1e-4, rtol=1e-4)
