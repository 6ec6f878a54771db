"""A full fine-tune of a Hugging Face model (model.init_from, no LoRA) resumes from its checkpoint after the source
directory is gone: the checkpoint holds every weight, the run directory keeps the source's other files (init_from/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.state.rundir import checkpoints
from kiln.train.run import run

from .test_lora_train import Keep

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def config(root: Path, base: Path, run_dir: Path, *extra: str):
    return load_config(None, [
        f"model.init_from={base}", f"data.sources=[{root / 'corpus'}]", f"data.cache_dir={root / 'cache'}",
        "data.val_fraction=0.1", "data.text_unit=paragraph", "data.document_mask=false", "data.workers=1",
        "train.seq_len=32", "train.batch_size=4", "train.max_steps=6", "train.eval_every=0", "train.eval_batches=2",
        "train.warmup_steps=2", "train.lr=1e-2", "train.device=cpu", "train.precision=fp32", "train.sample_tokens=0",
        f"train.run_dir={run_dir}", "checkpoint.every=3", "checkpoint.async_save=false", "logging.every=1",
        "logging.console=false", "logging.plots=false", *extra])


def test_a_full_fine_tune_resumes_after_its_source_directory_is_deleted(hf_llama, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(hf_llama / "model", base)
    full = Keep()
    run(config(hf_llama, base, tmp_path / "full"), callbacks=[full])
    cfg = config(hf_llama, base, tmp_path / "run")
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg, callbacks=[Keep(crash_at=5)])
    assert checkpoints(tmp_path / "run")  # the one of step 3, and the emergency one of step 5
    shutil.rmtree(base)
    again = Keep()
    run(cfg, callbacks=[again])
    assert min(again.losses) > 1  # resumed from a checkpoint
    for step, loss in again.losses.items():
        assert loss == full.losses[step], step
    assert (tmp_path / "run" / "init_from" / "tokenizer.json").is_file()  # the copy it read stays


def test_a_lora_run_whose_base_is_gone_says_its_checkpoints_lack_the_base(hf_llama, tmp_path):
    """The checkpoints of a LoRA run hold the adapters, not the frozen base: the error names the missing directory
    and says to put it back or point model.init_from at it."""
    from kiln.errors import StateError

    base = tmp_path / "base"
    shutil.copytree(hf_llama / "model", base)
    lora = ["lora.rank=4", "lora.alpha=8", "lora.targets=[q,v]", "lora.base_dtype=fp32"]
    run(config(hf_llama, base, tmp_path / "run", "train.max_steps=3", *lora))
    shutil.rmtree(base)
    with pytest.raises(StateError, match=rf"init_from={base} is gone.*adapters only.*model.init_from=DIR"):
        run(config(hf_llama, base, tmp_path / "run", *lora))
