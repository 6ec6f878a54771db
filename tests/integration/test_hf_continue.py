"""Continued pretraining end to end: a random Llama in the Hugging Face layout is imported
(model.init_from), trained 20 steps, exported, and transformers' loss on the held-out batches equals
Kiln's last evaluation."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.config import load_config
from kiln.data.prepare.tokenizer import train_bpe
from kiln.errors import DataError
from kiln.state.export import export_from
from kiln.train.events import Callback
from kiln.train.run import run

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
STDLIB = Path(sysconfig.get_paths()["stdlib"])


class LastEval(Callback):
    """Keeps the last evaluation's metrics and the validation batches it scored."""

    def on_eval_end(self, trainer, metrics):
        trainer.val_loader.reset()
        self.metrics = metrics
        self.batches = [next(trainer.val_loader) for _ in range(trainer.cfg.train.eval_batches)]


def _overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.init_from={root / 'model'}", f"data.sources=[{root / 'corpus'}]",
            f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.1", "data.text_unit=paragraph",
            "data.document_mask=false", "data.workers=1",
            "train.seq_len=32", "train.batch_size=4", "train.max_steps=20", "train.eval_every=0",
            "train.eval_batches=2", "train.warmup_steps=2", "train.lr=3e-3", "train.device=cpu",
            "train.precision=fp32", "train.sample_tokens=0", f"train.run_dir={run_dir}", "checkpoint.every=0",
            "checkpoint.async_save=false", "logging.console=false", *extra]


def test_import_train_export_loss_matches_transformers(hf_llama, tmp_path):
    cfg = load_config(None, _overrides(hf_llama, tmp_path / "run"))
    assert cfg.data.tokenizer == str(hf_llama / "model")  # kiln prepare / train use the model's tokenizer
    last = LastEval()
    run_dir = run(cfg, callbacks=[last])
    assert last.metrics["step"] == 20
    for source in (run_dir, run_dir / "checkpoints"):  # the final model/, and the final DCP checkpoint
        src = source if source == run_dir else sorted(source.iterdir())[-1]
        out = export_from(src, tmp_path / f"export-{src.name}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        losses = []
        with torch.no_grad():
            for x, y, _ in last.batches:
                logits = hf(input_ids=x).logits
                losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100))
        hf_loss = torch.stack(losses).mean().item()
        assert abs(hf_loss - last.metrics["val_loss"]) < 1e-4, (src, hf_loss, last.metrics["val_loss"])
    start = transformers.AutoModelForCausalLM.from_pretrained(hf_llama / "model").eval()
    with torch.no_grad():  # and the run did train the imported weights: the start scored worse
        x, y, _ = last.batches[0]
        before = F.cross_entropy(start(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
    assert before > last.metrics["val_loss"] + 0.1


def test_data_with_another_tokenizer_is_refused(hf_llama, tmp_path):
    other = train_bpe([(STDLIB / "csv.py").read_text()], 400)
    other.save(tmp_path / "other.json")
    cfg = load_config(None, _overrides(hf_llama, tmp_path / "run", f"data.tokenizer={tmp_path / 'other.json'}"))
    with pytest.raises(DataError, match="model.init_from=.*its token ids would mean other text"):
        run(cfg)
