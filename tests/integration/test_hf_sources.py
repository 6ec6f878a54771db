"""kiln eval and kiln export of a Hugging Face directory take every architecture kiln train takes (a Gemma, through
the auto path); an export comes back in the dtype its source stores; a pickle refusal advises what the command
takes; a damaged pickle on the auto path is a StateError; an auto run's model keeps the source's use_cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.config import ModelConfig
from kiln.errors import StateError
from kiln.evaluate import evaluate
from kiln.model.hf_auto import auto_config, build_auto
from kiln.model.llama import Transformer
from kiln.state.export import export_from, export_hf
from kiln.state.weights import save_model

from .hf_dirs import tokenizer, write_corpus, write_hf_dir

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    write_hf_dir(root / "gemma", "gemma")
    write_corpus(root / "corpus", 2)
    return root


def logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=x).logits


def test_a_non_native_directory_exports_and_evaluates(root, tmp_path):
    out = export_from(root / "gemma", tmp_path / "out")
    x = torch.randint(0, 320, (1, 12))
    torch.testing.assert_close(logits(out, x), logits(root / "gemma", x), atol=1e-6, rtol=1e-6)
    result = evaluate(root / "gemma", [str(root / "corpus")], max_tokens=256, device="cpu")
    assert result["kind"] == "hf" and 0 < result["loss"] < 10


def test_export_defaults_to_the_dtype_of_its_source(root, tmp_path):
    tok = tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64,
                                    max_seq_len=64, tie_embeddings=False))
    export_hf(model, model.cfg, tok, tmp_path / "base", dtype="bf16")  # a base stored in bf16
    trained = model.cfg.model_copy(update={"init_from": str(tmp_path / "base")})
    save_model(model, trained, tok, tmp_path / "run" / "model")  # trained in fp32 from it
    out = export_from(tmp_path / "run", tmp_path / "out")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    full = export_from(tmp_path / "run", tmp_path / "fp32", dtype="fp32")  # asked for: kept
    assert {t.dtype for t in load_file(str(full / "model.safetensors")).values()} == {torch.float32}
    gemma = export_from(root / "gemma", tmp_path / "gemma")  # an auto-path source: fp32, stays fp32
    assert {t.dtype for t in load_file(str(gemma / "model.safetensors")).values()} == {torch.float32}


def pickled(root: Path, tmp_path: Path) -> Path:
    path = tmp_path / "pickled"
    write_hf_dir(path, "gemma")
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    return path


@pytest.mark.parametrize("command", ["export", "eval"])
def test_pickle_refusal_advises_what_the_command_takes(root, tmp_path, command):
    path = pickled(root, tmp_path)
    with pytest.raises(StateError, match=f"pickled .*give the new directory to kiln {command}$") as e:
        if command == "export":
            export_from(path, tmp_path / "out")
        else:
            evaluate(path, [str(root / "corpus")], device="cpu")
    assert "allow_pickle" not in str(e.value)


def test_a_damaged_pickle_on_the_auto_path_is_a_state_error(root, tmp_path):
    path = pickled(root, tmp_path)
    (path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip archive nor a pickle")
    cfg = auto_config(ModelConfig(init_from=str(path), hf_class="auto", allow_pickle=True))
    with pytest.raises(StateError, match="its weights cannot be read"):
        build_auto(cfg)


def test_an_auto_models_config_keeps_the_sources_use_cache(root, tmp_path):
    model = build_auto(auto_config(ModelConfig(init_from=str(root / "gemma"), hf_class="auto")))
    model.save_pretrained(tmp_path / "saved")
    source = json.loads((root / "gemma" / "config.json").read_text())
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["use_cache"] == source["use_cache"] is True


def test_a_model_without_tokenizer_files_trains_with_data_tokenizer(root, tmp_path):
    from kiln.config import load_config
    from kiln.train.run import run

    from .conftest import losses

    path = write_hf_dir(tmp_path / "llama", "llama")
    (path / "tokenizer.json").rename(tmp_path / "tokenizer.json")  # the model ships none; the user gives it
    run_dir = run(load_config(None, [
        f"model.init_from={path}", f"data.tokenizer={tmp_path / 'tokenizer.json'}", f"data.sources=[{root / 'corpus'}]",
        f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=32", "train.batch_size=2", "train.max_steps=2",
        "train.eval_every=0", "train.device=cpu", "train.sample_tokens=0", f"train.run_dir={tmp_path / 'run'}",
        "logging.every=1", "logging.console=false", "logging.plots=false"]))
    assert sorted(losses(run_dir)) == [1, 2]
