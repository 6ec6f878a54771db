"""LoRA end to end: a random Llama in the Hugging Face layout is imported (model.init_from) and adapted
for a few steps on the CPU; the base stays bit for bit, checkpoints hold the adapters only (small), a
crashed run resumes to the very same adapters, a changed base is refused, and both exports (merged
weights; adapters in PEFT's format, loaded by peft onto the base) give Kiln's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kiln.config import load_config
from kiln.errors import ConfigError, StateError
from kiln.model.hf_import import import_hf
from kiln.model.lora import adapter_state_dict, is_adapter_key
from kiln.model.lora_peft import read_peft_adapters
from kiln.state.export import export_from
from kiln.state.rundir import checkpoints
from kiln.train.events import Callback
from kiln.train.run import run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow
STEPS = 8


class Keep(Callback):
    """Keeps the trained model (the LoRA Transformer itself) and each step's loss; can crash at a step."""

    def __init__(self, crash_at: int | None = None):
        self.crash_at, self.losses, self.val_losses = crash_at, {}, []

    def on_step_end(self, trainer, metrics):
        if metrics:
            self.losses[trainer.step] = metrics["loss"]
        if trainer.step == self.crash_at:
            raise RuntimeError("injected failure")

    def on_eval_end(self, trainer, metrics):
        self.val_losses.append(metrics["val_loss"])

    def on_train_end(self, trainer, metrics):
        self.model = trainer.model


def config(root: Path, run_dir: Path, *extra: str, base: Path | None = None):
    return load_config(None, [
        f"model.init_from={base or root / 'model'}", f"data.sources=[{root / 'corpus'}]",
        f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.1", "data.text_unit=paragraph",
        "data.document_mask=false", "data.workers=1", "train.seq_len=32", "train.batch_size=4",
        f"train.max_steps={STEPS}", "train.eval_every=0", "train.eval_batches=2", "train.warmup_steps=2",
        "train.lr=1e-2", "train.device=cpu", "train.precision=fp32", "train.sample_tokens=0",
        f"train.run_dir={run_dir}", "checkpoint.every=4", "checkpoint.async_save=false", "logging.every=1",
        "logging.console=false", "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "lora.targets=[q,v,up]",
        "lora.base_dtype=fp32", *extra])


@pytest.fixture(scope="module")
def trained(hf_llama, tmp_path_factory):
    """One uninterrupted LoRA run of STEPS steps: (run directory, its Keep)."""
    keep = Keep()
    run_dir = run(config(hf_llama, tmp_path_factory.mktemp("runs") / "run"), callbacks=[keep])
    return run_dir, keep


def test_only_adapters_train_and_checkpoints_hold_them_alone(hf_llama, trained):
    run_dir, keep = trained
    _, base = import_hf(hf_llama / "model")
    state = keep.model.state_dict()
    assert {k for k in state if not is_adapter_key(k)} == set(base)
    for key, value in base.items():  # the base weights are exactly init_from's after training
        assert torch.equal(state[key], value), key
    assert keep.val_losses[-1] < keep.val_losses[0] - 0.01  # and the adapters did learn
    assert any(v.abs().max() > 0 for k, v in state.items() if ".lora_B." in k)
    base_bytes = (hf_llama / "model" / "model.safetensors").stat().st_size
    adapters = adapter_state_dict(keep.model)
    for ckpt in checkpoints(run_dir):
        saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        model_part = {k.removeprefix("model."): v.size for k, v in saved.items() if k.startswith("model.")}
        assert model_part == {k: v.shape for k, v in adapters.items()}  # the adapters, nothing of the base
        files = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
        # 3,328 adapter parameters and their two AdamW moments (and DCP's ~1 kB per entry), against the
        # base's 140k: a third at this toy size, a percent or less at real ones
        assert 0 < files < base_bytes / 3, (ckpt, files, base_bytes)
    meta_prints = json.loads((checkpoints(run_dir)[-1] / "meta.json").read_text())["fingerprints"]
    assert len(meta_prints["base_model"]) == 64  # the base, referenced by its sha256


def test_resume_after_a_crash_gives_the_same_adapters(hf_llama, trained, tmp_path):
    _, full = trained
    cfg = config(hf_llama, tmp_path / "run")
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg, callbacks=[Keep(crash_at=6)])
    assert [p.name for p in checkpoints(tmp_path / "run")][0] == "step_00000004"
    again = Keep()
    run(cfg, callbacks=[again])
    assert min(again.losses) in (5, 7)  # resumed from a checkpoint, not from the start
    for step, loss in again.losses.items():
        assert loss == full.losses[step], step
    ours, theirs = adapter_state_dict(again.model), adapter_state_dict(full.model)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_a_changed_base_is_refused_on_resume(hf_llama, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(hf_llama / "model", base)
    cfg = config(hf_llama, tmp_path / "run", "train.max_steps=4", base=base)
    run(cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3)
    model.save_pretrained(base)
    with pytest.raises(StateError, match="the base changed"):
        run(config(hf_llama, tmp_path / "run", "train.max_steps=6", base=base), resume="force")
    with pytest.raises(StateError, match="the base changed"):  # nor does an export merge onto it
        export_from(checkpoints(tmp_path / "run")[-1], tmp_path / "out")


def test_lora_without_init_from_is_a_config_error(hf_llama, tmp_path):
    cfg = config(hf_llama, tmp_path / "run").model_copy(deep=True)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": None})})
    with pytest.raises(ConfigError, match="lora.rank is set but model.init_from is not"):
        run(cfg)


def test_exports_merged_and_peft_adapters_give_kilns_logits(hf_llama, trained, tmp_path):
    run_dir, keep = trained
    model = keep.model.eval()
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(x)
    assert (run_dir / "model" / "adapters" / "adapter_config.json").is_file()
    sources = {"run": run_dir, "checkpoint": checkpoints(run_dir)[-1]}
    for name, src in sources.items():
        merged = transformers.AutoModelForCausalLM.from_pretrained(export_from(src, tmp_path / f"m-{name}")).eval()
        adapters = export_from(src, tmp_path / f"a-{name}", adapters=True)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_llama / "model")
        with_peft = peft.PeftModel.from_pretrained(hf, adapters).eval()
        assert sorted(with_peft.peft_config["default"].target_modules) == ["q_proj", "up_proj", "v_proj"]
        # the base's tokenizer beside the adapters, as the Hugging Face Trainer leaves it: AutoTokenizer reads it here
        assert (adapters / "tokenizer.json").read_bytes() == (hf_llama / "model" / "tokenizer.json").read_bytes()
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=x).logits, ours, rtol=0, atol=1e-5, msg=name)
            torch.testing.assert_close(with_peft(input_ids=x).logits, ours, rtol=0, atol=1e-5, msg=name)
    with pytest.raises(StateError, match="no LoRA adapters"):
        export_from(hf_llama / "model", tmp_path / "none", adapters=True)


def test_kiln_export_adapters_on_the_command_line(trained, tmp_path):
    from typer.testing import CliRunner

    from kiln.cli import app

    run_dir, keep = trained
    result = CliRunner().invoke(app, ["export", str(run_dir), "--to", str(tmp_path / "a"), "--adapters",
                                      "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    adapters, config = read_peft_adapters(tmp_path / "a")
    assert config["target_modules"] == ["q_proj", "up_proj", "v_proj"] and config["lora_alpha"] == 8.0
    expected = adapter_state_dict(keep.model)
    assert adapters.keys() == expected.keys()
    assert all(adapters[k].dtype == torch.bfloat16 and torch.equal(adapters[k], v.bfloat16())
               for k, v in expected.items())


def test_one_step_exports_one_model_over_a_bf16_training_base(hf_llama, tmp_path):
    """With the default lora.base_dtype=bf16 over a base stored in fp32, the final model/ and the last checkpoint
    export the same model (they were 0.168 apart in logits: model/ was merged onto the bf16 training copy), and it
    is the adapters on the base as the user brought it, as PEFT computes it in fp32."""
    run_dir = run(config(hf_llama, tmp_path / "run", "lora.base_dtype=bf16", "train.max_steps=4"))
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, src in {"run": run_dir, "checkpoint": checkpoints(run_dir)[-1]}.items():
        out = export_from(src, tmp_path / f"out-{name}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            logits[name] = hf.eval()(input_ids=x).logits
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama / "model", dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(base, export_from(run_dir, tmp_path / "a", adapters=True)).eval()
    with torch.no_grad():
        truth = with_peft(input_ids=x).logits
    torch.testing.assert_close(logits["run"], logits["checkpoint"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits["run"], truth, rtol=0, atol=1e-5)
