"""An export of a model that came from a Hugging Face directory (model.init_from) carries what that directory
says besides its weights: tokenizer files, special tokens, chat template, generation config, the special token
ids of config.json. Every JSON file of the source is diffed against the export: only what Kiln changed on
purpose (here the weights' dtype) differs."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from kiln.config import load_config
from kiln.data.prepare.tokenizer import Tokenizer
from kiln.state.export import ExportWarning, export_from
from kiln.train.run import run

from .hf_dirs import CHAT_TEMPLATE, dress, json_changes, llama_tokenizer, write_corpus, write_hf_dir

transformers = pytest.importorskip("transformers")


def overrides(root: Path, src: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.init_from={src}", f"data.sources=[{root / 'corpus'}]", f"data.cache_dir={root / 'cache'}",
            "data.workers=1", "data.val_fraction=0", "train.seq_len=32", "train.batch_size=4", "train.max_steps=4",
            "train.eval_every=0", "train.lr=3e-3", "train.device=cpu", "train.precision=fp32",
            "train.sample_tokens=0", f"train.run_dir={run_dir}", "checkpoint.every=4", "checkpoint.async_save=false",
            "logging.console=false", "logging.plots=false", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A dressed Llama (native) and Gemma (hf_class=auto), each trained 4 steps."""
    root = tmp_path_factory.mktemp("hffiles")
    write_corpus(root / "corpus", 4)
    for kind, extra in (("llama", ()), ("gemma", ("model.hf_class=auto",))):
        dress(write_hf_dir(root / kind, kind))
        run(load_config(None, overrides(root, root / kind, root / f"run-{kind}", *extra)))
    return root


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("what", ["run", "checkpoint"])
def test_every_json_of_the_source_survives_export(runs, kind, what, tmp_path):
    run_dir = runs / f"run-{kind}"
    src = run_dir if what == "run" else sorted((run_dir / "checkpoints").iterdir())[-1]
    out = export_from(src, tmp_path / "fp32")
    assert json_changes(runs / kind, out) == {}
    out = export_from(src, tmp_path / "bf16", dtype="bf16")
    assert json_changes(runs / kind, out) == {"config.json": {"dtype": ("float32", "bfloat16")}}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.chat_template) == ("<s>", "</s>", "<unk>", CHAT_TEMPLATE)
    assert tok("def f")["input_ids"][0] == 1  # the post-processor's <s>
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s>user: hi</s><s>assistant: "
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.do_sample, gen.temperature, gen.top_p) == ([1, 2], True, 0.6, 0.9)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (1, 2, 0)


def test_the_final_model_of_an_auto_run_keeps_its_sources_files(runs):
    """An auto run's model/ is transformers' own layout, which from_pretrained loads as it is: it carries the source's
    tokenizer files, generation config and config.json as an export does (it used to hold save_pretrained's config
    and tokenizer.json alone: no chat template, no special tokens, no stop tokens)."""
    assert json_changes(runs / "gemma", runs / "run-gemma" / "model") == {}
    tok = transformers.AutoTokenizer.from_pretrained(runs / "run-gemma" / "model")
    assert (tok.bos_token, tok.eos_token, tok.chat_template) == ("<s>", "</s>", CHAT_TEMPLATE)


def test_another_tokenizer_is_written_as_kilns_own(runs, tmp_path):
    other = llama_tokenizer()  # the same ids, without the post-processor's <s>: not the source's tokenizer
    other.tk.post_processor = None
    other = Tokenizer(other.tk, eos_token="</s>")
    other.save(tmp_path / "other.json")
    out = export_from(runs / "run-llama", tmp_path / "out", tokenizer=tmp_path / "other.json")
    assert Tokenizer.load(out).hash == other.hash
    changes = json_changes(runs / "llama", out)
    assert set(changes) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
                            "special_tokens_map.json"}
    assert changes["config.json"]["bos_token_id"] == (1, None)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_a_source_that_is_gone_is_said(runs, tmp_path):
    """The run's copy of its source's files (init_from/) stands for the source where it is gone; a run without one
    (made before Kiln kept it) exports with Kiln's own tokenizer files, and says so."""
    moved = tmp_path / "moved"
    shutil.copytree(runs / "run-llama", moved)
    shutil.move(runs / "llama", tmp_path / "llama-away")
    try:
        for what in (moved, sorted((moved / "checkpoints").iterdir())[-1]):
            with warnings.catch_warnings():
                warnings.simplefilter("error", ExportWarning)
                kept = export_from(what, tmp_path / f"kept-{what.name}")
            assert json_changes(tmp_path / "llama-away", kept) == {}
        shutil.rmtree(moved / "init_from")
        with pytest.warns(ExportWarning, match="is not there any more.*chat template"):
            out = export_from(moved, tmp_path / "out")
        from typer.testing import CliRunner

        from kiln.cli import app

        said = CliRunner().invoke(app, ["export", str(moved), "--to", str(tmp_path / "cli")])
        assert said.exit_code == 0 and "warning: model.init_from=" in said.output  # a line, not a Python warning
        assert "UserWarning" not in said.output
    finally:
        shutil.move(tmp_path / "llama-away", runs / "llama")
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())


def test_a_context_extended_on_purpose_is_written_out(runs, tmp_path):
    """model.max_seq_len over the model's 64 positions, with linear rope scaling: the export advertises 128 positions
    and the scaling, generation_config.json's max_length of 64 (the model's context) follows (it stayed 64), and
    transformers' logits over 100 tokens are Kiln's."""
    from kiln.state.weights import load_model

    extend = ("model.max_seq_len=128", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2")
    run_dir = run(load_config(None, overrides(runs, runs / "llama", tmp_path / "run", *extend)))
    out = export_from(run_dir, tmp_path / "out")
    changes = json_changes(runs / "llama", out)
    assert set(changes) == {"config.json", "generation_config.json"}
    assert changes["generation_config.json"] == {"max_length": (64, 128)}
    assert transformers.GenerationConfig.from_pretrained(out).max_length == 128
    assert changes["config.json"]["max_position_embeddings"] == (64, 128)
    assert changes["config.json"]["rope_parameters"][1] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert set(changes["config.json"]) <= {"max_position_embeddings", "rope_parameters", "rope_scaling"}
    model, _ = load_model(run_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 320, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=x).logits - model(x)).abs().max() < 1e-5


def test_a_run_bounded_below_the_models_context_exports_the_models_context(runs, tmp_path):
    """model.max_seq_len=32 beside a model of 64 positions bounds the run, and the export still says 64 (it used to
    say 32, in config.json and tokenizer_config.json)."""
    run_dir = run(load_config(None, overrides(runs, runs / "llama", tmp_path / "run", "model.max_seq_len=32")))
    assert json_changes(runs / "llama", export_from(run_dir, tmp_path / "out")) == {}


def test_a_longer_context_without_saying_so_is_a_config_error(runs, tmp_path):
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="longer than the 64 positions"):
        run(load_config(None, overrides(runs, runs / "llama", tmp_path / "a", "model.max_seq_len=128")))
    with pytest.raises(ConfigError, match="train.seq_len=96 is longer than the 64 positions"):
        run(load_config(None, overrides(runs, runs / "llama", tmp_path / "b", "train.seq_len=96")))


def test_the_model_card_names_the_base_and_a_conversion_keeps_the_sources(runs, tmp_path):
    card = (export_from(runs / "run-llama", tmp_path / "a") / "README.md").read_text()
    assert f"continued pretraining of `{runs / 'llama'}`" in card and f"| base model | `{runs / 'llama'}` |" in card
    assert "| steps | 4 of 4 |" in card and "license" not in card.split("---")[1]
    (runs / "llama" / "README.md").write_text("---\nlicense: llama3\n---\n# Llama\n")
    try:
        out = export_from(runs / "llama", tmp_path / "b")  # a Hugging Face directory converted: its own card
        trained = (export_from(runs / "run-llama", tmp_path / "c") / "README.md").read_text()
    finally:
        (runs / "llama" / "README.md").unlink()
    assert (out / "README.md").read_text() == "---\nlicense: llama3\n---\n# Llama\n"
    assert yaml.safe_load(trained.split("---")[1])["license"] == "llama3"  # a model trained from it: its license
