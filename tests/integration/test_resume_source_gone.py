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


def test_a_resume_without_its_source_records_the_source_not_the_runs_copy(hf_llama, tmp_path):
    """The resume read the run's copy of the source's files (RUN/init_from) and recorded that copy as model.init_from
    and data.tokenizer (config.yaml, its checkpoints, model/): the exported card named the copy, config and tokenizer
    without weights, as the model's base, and the run moved elsewhere read the copy at its old place, of whatever
    run is there since. It records the source as given, and every resume reads its own run's copy."""
    import json

    import yaml

    from kiln.state.model_card import model_card

    from ..conftest import kiln_here

    base, run_dir, moved = tmp_path / "base", tmp_path / "run", tmp_path / "moved"
    shutil.copytree(hf_llama / "model", base)
    run(config(hf_llama, base, run_dir, "train.max_steps=3"))

    def source(saved: dict) -> tuple:
        return saved["model"]["init_from"], saved["data"]["tokenizer"]

    given = source(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert given[0] == str(base)
    shutil.rmtree(base)
    run(config(hf_llama, base, run_dir, "train.max_steps=4"), resume="force")
    assert source(yaml.safe_load((run_dir / "config.yaml").read_text())) == given
    assert source(json.loads((run_dir / "checkpoints" / f"step_{4:08d}" / "meta.json").read_text())["config"]) == given
    assert json.loads((run_dir / "model" / "model_config.json").read_text())["init_from"] == str(base)
    assert f"continued pretraining of `{base}`" in model_card(run_dir / "model")

    shutil.move(run_dir, moved)  # and another run in its old place, of another model
    (run_dir / "init_from").mkdir(parents=True)
    other = json.loads((hf_llama / "model" / "config.json").read_text())
    (run_dir / "init_from" / "config.json").write_text(json.dumps({**other, "hidden_size": 32}))
    again = kiln_here("train", str(moved), "train.max_steps=5", "--resume", "force")
    assert again.returncode == 0, again.stderr + again.stdout
    assert f"model.init_from={base} is gone" in again.stdout and "resumed from" in again.stdout
    assert f"run's copy {moved / 'init_from'}" in again.stdout
