"""model.init_from: what a Hugging Face directory sets, and the errors a user can cause with it."""

from __future__ import annotations

import json

import pytest

from kiln.config import ModelConfig
from kiln.errors import ConfigError, StateError
from kiln.model.hf import to_hf_config_dict
from kiln.model.hf_import import resolve_init_from, weight_files


@pytest.fixture
def hf_dir(tmp_path):
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=4096, attention_bias="qkv")
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return tmp_path


def test_init_from_sets_the_architecture_and_keeps_max_seq_len(hf_dir):
    cfg = resolve_init_from(ModelConfig(init_from=str(hf_dir)))
    assert (cfg.vocab_size, cfg.attention_bias, cfg.hf_model_type, cfg.max_seq_len) == (128, "qkv", "qwen2", 4096)
    assert cfg.init_from == str(hf_dir)
    shorter = resolve_init_from(ModelConfig(init_from=str(hf_dir), max_seq_len=512))
    assert shorter.max_seq_len == 512


def test_fields_that_contradict_init_from_are_a_config_error(hf_dir):
    with pytest.raises(ConfigError, match=r"also sets model.d_model=256 \(the model has 64\)"):
        resolve_init_from(ModelConfig(init_from=str(hf_dir), d_model=256))
    assert resolve_init_from(ModelConfig(init_from=str(hf_dir), d_model=64)).d_model == 64  # agreeing is fine


def test_an_init_from_override_replaces_the_presets_model_fields(hf_dir, tmp_path):
    from kiln.config import load_config

    cfg = load_config("quickstart", [f"model.init_from={hf_dir}"])  # the preset sets d_model=256, n_layers=4
    model = resolve_init_from(cfg.model)
    assert (model.d_model, model.n_layers, model.attention_bias) == (64, 2, "qkv")
    assert cfg.data.tokenizer == str(hf_dir)  # the model's own tokenizer
    mine = tmp_path / "mine.yaml"  # fields written beside init_from in one file are still a contradiction
    mine.write_text(f"model:\n  init_from: {hf_dir}\n  d_model: 256\n")
    with pytest.raises(ConfigError, match="model.d_model=256"):
        resolve_init_from(load_config(mine).model)


def test_missing_directory_config_or_weights(tmp_path, hf_dir):
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path / "empty")))
    with pytest.raises(StateError, match="holds no weights"):
        weight_files(hf_dir)
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(StateError, match="lists shards that are not in .*model-1.safetensors"):
        weight_files(hf_dir)


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "hidden_size": 8}))
    with pytest.raises(StateError, match="'nemotron_h'.*llama, mistral, qwen2, nemotron"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path)))
