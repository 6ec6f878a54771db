"""kiln.train.run's checks before any work: a model shape no Hugging Face class can hold is said then, not when
`kiln export` fails at the end."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kiln.config import load_config
from kiln.errors import ConfigError, DataError
from kiln.train.run import run


def test_a_shape_export_cannot_write_is_said_before_training(tmp_path):
    args = ["model.size=tiny", "model.mlp=relu2", "train.device=cpu",
            "data.sources=[nowhere]"]
    out = io.StringIO()
    with pytest.raises(DataError):  # the warning comes first; then the missing data stops the run
        run(load_config(None, [*args, f"train.run_dir={tmp_path / 'a'}"]), console=Console(file=out, width=400))
    assert "warning: no Hugging Face class holds this model shape" in out.getvalue()
    assert "model.norm=rmsnorm" in out.getvalue() and "kiln export` will not be able to write it" in out.getvalue()
    with pytest.raises(ConfigError, match="model.hf_model_type=llama: .*LlamaForCausalLM cannot have model.mlp=relu2"):
        run(load_config(None, [*args, "model.hf_model_type=llama", f"train.run_dir={tmp_path / 'b'}"]))
    assert not (tmp_path / "b").exists()  # refused before the run directory was made


def test_a_model_directory_with_fewer_embeddings_than_its_tokenizer_says_so_of_the_directory(tmp_path):
    """model.init_from's vocab_size comes from its config.json: the error told to raise model.vocab_size (or leave it
    null), which init_from does not take; it now names the directory and the tokenizer that does not fit it."""
    import json
    import sysconfig
    from pathlib import Path

    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.model.hf import to_hf_config_dict

    model = tmp_path / "model"  # its tokenizer.json is another model's: 271 tokens for 256 embeddings
    model.mkdir()
    tok = train_bpe(["def f(x):\n    return x\n"] * 20, 280)
    tok.save(model / "tokenizer.json")
    (model / "config.json").write_text(json.dumps(to_hf_config_dict(load_config(None, ["model.vocab_size=256",
                                                                                 "model.size=tiny"]).model)))
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "this.py"
    args = [f"data.sources=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0",
            "train.device=cpu", "train.seq_len=32", "logging.console=false"]
    with pytest.raises(ConfigError, match=f"model.init_from={model} has vocab_size=256 .*fewer than the "
                                          f"{tok.vocab_size} tokens of data.tokenizer={model}.*not the model's") as e:
        run(load_config(None, [*args, f"model.init_from={model}", f"train.run_dir={tmp_path / 'a'}"]))
    assert "leave it null" not in str(e.value)
    with pytest.raises(ConfigError, match=f"model.vocab_size=256 is smaller than the tokenizer's {tok.vocab_size}"):
        run(load_config(None, [*args, "model.vocab_size=256", f"data.tokenizer={model}",
                               f"train.run_dir={tmp_path / 'b'}"]))


def test_a_model_directory_without_a_tokenizer_asks_for_the_models_tokenizer(tmp_path):
    """model.init_from of a directory with weights but no tokenizer files: the error advised data.tokenizer=null (train
    one on the sources), which init_from replaces with the directory again (and a new tokenizer's ids would mean other
    text to the model): the same error came back. It now asks for the tokenizer the model was trained with."""
    import json
    import sysconfig
    from pathlib import Path

    from kiln.model.hf import to_hf_config_dict

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(to_hf_config_dict(load_config(None, ["model.size=tiny",
                                                                                 "model.vocab_size=256"]).model)))
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "this.py"
    for given in ([], ["data.tokenizer=null"]):
        with pytest.raises(ConfigError, match=f"model.init_from={model} holds no tokenizer files.*set data.tokenizer "
                                              "to the tokenizer the model was trained with") as e:
            run(load_config(None, [f"model.init_from={model}", *given, f"data.sources=[{corpus}]",
                                   f"data.cache_dir={tmp_path / 'cache'}", "train.device=cpu", "train.seq_len=32",
                                   f"train.run_dir={tmp_path / 'run'}", "logging.console=false"]))
        assert "null" not in str(e.value)
    from typer.testing import CliRunner

    from kiln.cli import app

    said = CliRunner().invoke(app, ["prepare", f"model.init_from={model}", f"data.sources=[{corpus}]",
                                    f"data.cache_dir={tmp_path / 'cache'}"])
    assert isinstance(said.exception, ConfigError)  # kiln prepare too (the CLI prints it without a traceback)
    assert "set data.tokenizer to the tokenizer the model was trained with" in str(said.exception)


def test_a_failed_start_takes_away_the_run_directory_it_made_and_nothing_the_user_had(tmp_path, monkeypatch):
    """Data missing: the start fails after its run directory is made. The directories it made (a/b/run; runs/ and
    runs/<timestamp> without train.run_dir) go, empty: the next `kiln train a/b/run` took the empty one for a
    directory without config.yaml. A directory the user made, or anything in it, stays."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    args = ["model.size=tiny", "train.device=cpu", "data.sources=[nowhere]", f"data.cache_dir={tmp_path / 'c'}"]
    for run_dir in (tmp_path / "a" / "b" / "run", None, mine, tmp_path / "empty"):
        if run_dir == tmp_path / "empty":
            run_dir.mkdir()
        with pytest.raises(DataError, match="nowhere"):
            run(load_config(None, [*args, *([f"train.run_dir={run_dir}"] if run_dir else [])]),
                console=Console(file=io.StringIO()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "empty", "mine"]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_models_dropout_the_native_model_does_not_apply_is_said_at_start(tmp_path):
    import json

    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.model.hf import to_hf_config_dict

    model = tmp_path / "model"
    model.mkdir()
    train_bpe(["def f(x):\n    return x\n"] * 20, 260).save(model / "tokenizer.json")
    config = to_hf_config_dict(load_config(None, ["model.size=tiny", "model.vocab_size=320"]).model)
    (model / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.1}))
    out = io.StringIO()
    with pytest.raises(DataError):  # the warning comes first; then the missing data stops the run
        run(load_config(None, [f"model.init_from={model}", "train.device=cpu", "train.seq_len=32",
                               "data.sources=[nowhere]", f"train.run_dir={tmp_path / 'run'}"]),
            console=Console(file=out, width=400))
    assert f"warning: model.init_from={model}: its config.json asks for dropout in training (attention_dropout=0.1)" \
        in out.getvalue()


def test_host_memory_for_the_offload_is_checked_before_any_data_is_prepared(tmp_path, monkeypatch):
    """train.offload=optimizer's host memory was checked once the data was prepared (hours on a big corpus)."""
    import sysconfig
    from pathlib import Path

    from kiln.errors import ResourceError
    from kiln.parallel import offload
    from kiln.train import run as run_module

    def prepared(*a, **k):
        raise AssertionError("the data was prepared before the offload's host memory was checked")

    monkeypatch.setattr(offload, "host_available", lambda: 10**6)  # 1 MB free
    monkeypatch.setattr(run_module, "build_data", prepared)
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "this.py"
    with pytest.raises(ResourceError, match="train.offload=optimizer keeps the training state"):
        run(load_config(None, ["model.size=tiny", "train.device=cpu", "train.offload=optimizer", "train.batch_size=2",
                               "train.seq_len=32", f"data.sources=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}",
                               f"train.run_dir={tmp_path / 'run'}"]), console=Console(file=io.StringIO()))
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
