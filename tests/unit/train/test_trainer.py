"""kiln.train.trainer: what a step's batch looks like when the model gets it; what a resumed run logs."""

from __future__ import annotations

import io
import json
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from kiln.config import load_config
from kiln.events import Callback
from kiln.train.run import run
from kiln.train.trainer import Trainer


def test_every_part_of_a_batch_goes_to_the_device_doc_ids_included():
    """DDP and FSDP2 copy an input left on the CPU with a blocking copy (a host wait for the whole GPU queue at
    every forward pass): the trainer hands the model tokens, targets and doc_ids on its device."""
    rows = torch.zeros(2, 8, dtype=torch.int64)
    loader = iter([(rows, rows, rows.to(torch.int32)), (rows, rows, None)])
    trainer = SimpleNamespace(device=torch.device("meta"))  # any device but the loader's
    tokens, targets, docs = Trainer._batch(trainer, loader)
    assert [t.device.type for t in (tokens, targets, docs)] == ["meta"] * 3 and docs.dtype == torch.int32
    assert Trainer._batch(trainer, loader)[2] is None  # no document masking: no doc_ids


def test_a_resumed_run_logs_the_losses_and_says_the_evaluation_it_started_from(tmp_path):
    """A run stopped between logging steps (step 6 of a log every 4) and resumed logged at step 8 the mean of steps
    7-8 only, where an uninterrupted run logs that of 5-8; and its summary called the step-4 evaluation 'at start'."""
    class CrashAt6(Callback):
        def on_step_end(self, trainer, metrics):
            if trainer.step == 6:
                raise RuntimeError("injected failure")  # an emergency checkpoint of step 6 is written

    (tmp_path / "corpus").mkdir()
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    for i in range(12):
        (tmp_path / "corpus" / f"{i:02d}.txt").write_text(text[i * 1500:(i + 1) * 1500])

    def go(name: str, **kw) -> str:
        out = io.StringIO()
        run(load_config(None, [
            "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.seq_len=16", "train.batch_size=2",
            "train.max_steps=8", "train.warmup_steps=1", "train.eval_every=4", "train.eval_batches=1",
            "train.sample_tokens=0", "train.device=cpu", "train.threads=1", "checkpoint.every=100",
            "checkpoint.save_final=false", "logging.every=4", "logging.plots=false",
            f"data.sources=[{tmp_path / 'corpus'}]", "data.val_fraction=0.2", "data.vocab_size=300",
            f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={tmp_path / name}"]),
            console=Console(file=out, width=300), **kw)
        return out.getvalue()

    def logged(name: str) -> dict[int, float]:
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in recs if r["event"] == "train"}

    said = go("whole")
    assert "validation loss: " in said and " at start -> " in said
    with pytest.raises(RuntimeError, match="injected failure"):
        go("cut", callbacks=[CrashAt6()])
    said = go("cut")
    assert logged("cut") == logged("whole")  # step 8's mean of steps 5-8, as uninterrupted
    assert " at step 4 -> " in said and " at start" not in said
