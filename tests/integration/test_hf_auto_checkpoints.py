"""Checkpoints of model.hf_class=auto runs read back as the transformers model they saved: `kiln export
--adapters` writes the adapters PEFT trained, `kiln eval` scores the checkpoint as it scores the final model,
and a checkpoint that does not hold the weights its config describes is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.errors import StateError
from kiln.evaluate import evaluate
from kiln.state.export import export_from
from kiln.train.run import run

from .hf_dirs import write_corpus, write_hf_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two 4-step auto runs of a tiny Gemma (not a native architecture): `lora` (rank 4) and `full`."""
    root = tmp_path_factory.mktemp("autockpt")
    write_hf_dir(root / "gemma", "gemma")
    write_corpus(root / "corpus", 4)
    for name, extra in (("lora", ["lora.rank=4", "lora.base_dtype=fp32"]), ("full", [])):
        run(load_config(None, [
            f"model.init_from={root / 'gemma'}", "model.hf_class=auto", f"data.sources=[{root / 'corpus'}]",
            f"data.cache_dir={root / 'cache'}", "data.val_fraction=0", "train.seq_len=32", "train.batch_size=4",
            "train.max_steps=4", "train.lr=1e-2", "train.warmup_steps=1", "train.eval_every=0",
            "train.device=cpu", "train.precision=fp32", "train.sample_tokens=0", f"train.run_dir={root / name}",
            "checkpoint.every=4", "checkpoint.async_save=false", "logging.console=false", "logging.plots=false",
            *extra]))
    return root


def checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").iterdir())[-1]


def test_lora_checkpoint_exports_the_adapters_peft_trained(runs, tmp_path):
    from safetensors.torch import load_file

    out = export_from(checkpoint(runs / "lora"), tmp_path / "adapters", adapters=True)
    got = load_file(str(out / "adapter_model.safetensors"))
    want = load_file(str(runs / "lora" / "model" / "adapters" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and got
    for key in want:  # the checkpoint is the final step's: the adapters the final model saved, bit for bit
        assert torch.equal(got[key], want[key]), key
    base = transformers.AutoModelForCausalLM.from_pretrained(runs / "gemma", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(runs / "lora" / "model", dtype=torch.float32).eval()
    x = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=x).logits, merged(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    # the final model's adapters/ export too (PEFT's keys, not Kiln's)
    again = export_from(runs / "lora", tmp_path / "again", adapters=True, dtype="bf16")
    assert load_file(str(again / "adapter_model.safetensors")).keys() == want.keys()


@pytest.mark.parametrize("name", ["lora", "full"])
def test_checkpoint_evaluates_as_the_final_model(runs, name):
    corpus = [str(runs / "corpus")]
    final = evaluate(runs / name, corpus, max_tokens=512, device="cpu")
    ckpt = evaluate(checkpoint(runs / name), corpus, max_tokens=512, device="cpu")
    assert ckpt["kind"] == "checkpoint" and math.isfinite(ckpt["loss"])
    assert ckpt["loss"] == pytest.approx(final["loss"], abs=1e-4)


def test_checkpoint_of_another_model_is_refused(runs, tmp_path):
    import shutil

    from kiln.state.verify import read_meta, write_meta

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    shutil.copytree(checkpoint(runs / "full"), ckpt)
    meta = read_meta(ckpt)
    meta["config"]["lora"]["rank"] = 4  # the config now says adapters; the files hold the whole model
    write_meta(ckpt, meta, fsync=False)
    with pytest.raises(StateError, match="does not hold the weights"):
        export_from(ckpt, tmp_path / "out", adapters=True)
    with pytest.raises(StateError, match="does not hold the weights"):
        evaluate(ckpt, [str(runs / "corpus")], max_tokens=512, device="cpu")
