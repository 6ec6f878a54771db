"""model.init_from: what a Hugging Face directory sets, and the errors a user can cause with it."""

from __future__ import annotations

import json
import re

import pytest

from kiln.config import ModelConfig, RopeScaling
from kiln.errors import ConfigError, StateError
from kiln.model.hf import to_hf_config_dict
from kiln.model.hf_import import resolve_init_from, weight_files


@pytest.fixture
def hf_dir(tmp_path):
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=4096, attention_bias="qkv",
                      hf_model_type="qwen2")
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    return tmp_path


def test_init_from_sets_the_architecture_and_the_context(hf_dir):
    cfg = resolve_init_from(ModelConfig(init_from=str(hf_dir)))
    assert (cfg.vocab_size, cfg.attention_bias, cfg.hf_model_type, cfg.max_seq_len) == (128, "qkv", "qwen2", 4096)
    assert cfg.init_from == str(hf_dir) and cfg.rope_scaling is None
    assert resolve_init_from(ModelConfig(init_from=str(hf_dir), max_seq_len=4096)).max_seq_len == 4096


def test_the_models_context_is_its_own_unless_extended_on_purpose(hf_dir):
    shorter = resolve_init_from(ModelConfig(init_from=str(hf_dir), max_seq_len=512))  # this run's bound
    assert (shorter.max_seq_len, shorter.rope_scaling) == (512, None)
    with pytest.raises(ConfigError, match="max_seq_len=16384 is longer than the 4096 positions.*rope_scaling.factor=4"):
        resolve_init_from(ModelConfig(init_from=str(hf_dir), max_seq_len=16384))
    with pytest.raises(ConfigError, match="rope_scaling beside .* set model.max_seq_len above its 4096"):
        resolve_init_from(ModelConfig(init_from=str(hf_dir), rope_scaling=RopeScaling(type="linear", factor=4)))
    longer = resolve_init_from(ModelConfig(init_from=str(hf_dir), max_seq_len=16384,
                                           rope_scaling=RopeScaling(type="linear", factor=4)))
    assert (longer.max_seq_len, longer.rope_scaling.type, longer.rope_scaling.factor) == (16384, "linear", 4.0)
    hf = to_hf_config_dict(longer)
    assert hf["max_position_embeddings"] == 16384 and hf["rope_scaling"]["factor"] == 4.0


def test_a_rope_scaling_field_set_beside_init_from_changes_that_field_alone(tmp_path):
    """model.rope_scaling.factor=16 on a Llama 3.1 whose scaling starts from 1024 positions keeps its 1024 and its
    frequency bands (they became the defaults: 8192, so the extended model was not the one asked for); a type of its
    own replaces the model's scaling whole."""
    from kiln.config import load_config

    llama31 = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=8192, rope_theta=5e5,
                          rope_scaling=RopeScaling(original_max_position_embeddings=1024, high_freq_factor=2.0))
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(llama31)))
    asked = ["model.max_seq_len=16384", "model.rope_scaling.factor=16"]
    model = resolve_init_from(load_config(None, [f"model.init_from={tmp_path}", *asked]).model)
    assert model.rope_scaling == llama31.rope_scaling.model_copy(update={"factor": 16.0})
    linear = ["model.max_seq_len=16384", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2"]
    model = resolve_init_from(load_config(None, [f"model.init_from={tmp_path}", *linear]).model)
    assert model.rope_scaling == RopeScaling(type="linear", factor=2.0)


def test_the_cpt_preset_keeps_a_long_context(tmp_path):
    """cpt-8b-4gpu trains 8192-token rows; a Llama-3.1 of 131072 positions stays one (it used to become 8192)."""
    from kiln.config import load_config

    llama31 = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=131072, rope_theta=5e5,
                          rope_scaling=RopeScaling(), tie_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(llama31)))
    cfg = load_config("cpt-8b-4gpu", [f"model.init_from={tmp_path}"])
    model = resolve_init_from(cfg.model)
    assert (cfg.train.seq_len, model.max_seq_len, model.rope_scaling) == (8192, 131072, RopeScaling())
    assert to_hf_config_dict(model)["max_position_embeddings"] == 131072


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
    with pytest.raises(ConfigError, match="has no config.json, so it is not a Hugging Face model directory$"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path / "empty")))
    (tmp_path / "empty" / "model_config.json").write_text("{}")  # a Kiln run's model/: how to start from it
    with pytest.raises(ConfigError, match=r"it is a Kiln run or its model/: export it first \(kiln export RUN_DIR"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path / "empty")))
    with pytest.raises(StateError, match="holds no weights"):
        weight_files(hf_dir)
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(StateError, match="lists shards that are not in .*model-1.safetensors"):
        weight_files(hf_dir)


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "jamba", "hidden_size": 8}))
    with pytest.raises(StateError, match="'jamba'.*llama, mistral, qwen2, nemotron"):
        resolve_init_from(ModelConfig(init_from=str(tmp_path)))


@pytest.mark.parametrize("architectures,add", [(["LlamaForCausalLM"], 'add "model_type": "llama" to it'),
                                               (None, "add the model type of its class to it"),
                                               (["GPT2LMHeadModel"], "add the model type of its class to it")])
def test_a_config_json_without_model_type_is_refused_not_read_as_llama(tmp_path, architectures, add):
    """transformers' AutoConfig refuses a config.json without model_type; Kiln read it as a Llama's."""
    from kiln.model.hf_import import native_architecture

    config = to_hf_config_dict(ModelConfig(size="tiny", vocab_size=256))
    del config["model_type"]
    if architectures is None:
        del config["architectures"]
    else:
        config["architectures"] = architectures
    (tmp_path / "config.json").write_text(json.dumps(config))
    said = f"{re.escape(str(tmp_path / 'config.json'))} has no model_type.*{add}.*or copy the model directory again"
    with pytest.raises(ConfigError, match=said):
        resolve_init_from(ModelConfig(init_from=str(tmp_path)))  # kiln train's model.init_from
    with pytest.raises(ConfigError, match=said):
        native_architecture(tmp_path)  # kiln eval and kiln export of a directory


@pytest.mark.parametrize("config,said", [({"model_type": "llama"}, "lacks 'hidden_size'"),
                                         ({"model_type": "llama", "hidden_size": -64, "num_attention_heads": 4,
                                           "vocab_size": 10, "num_hidden_layers": 2, "intermediate_size": 8},
                                          "d_model: Input should")])
def test_a_partial_or_damaged_config_json_is_said_not_a_traceback(tmp_path, config, said):
    """A config.json without hidden_size (or with a value out of range) gave `kiln export` and model.init_from a
    KeyError (or pydantic's ValidationError) traceback; it is no architecture for the auto path either."""
    from kiln.model.hf_import import native_architecture

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"this llama config.json .*{said}"):
        native_architecture(tmp_path)


def test_a_models_dropout_is_said_at_start_not_silently_dropped(tmp_path):
    """Kiln's native model has no dropout: a config.json that asks for it is told to the run, with the fields."""
    phi3 = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, fused_projections=True,
                       hf_model_type="phi3")
    config = to_hf_config_dict(phi3) | {"attention_dropout": 0.1, "resid_pdrop": 0.05, "embd_pdrop": 0.0,
                                        "classifier_dropout": 0.2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    said: list[str] = []
    resolve_init_from(ModelConfig(init_from=str(tmp_path)), said.append)
    assert len(said) == 1
    assert re.search(r"^warning: model.init_from=.*: its config.json asks for dropout in training \(attention_dropout="
                     r"0.1, resid_pdrop=0.05\), and Kiln's native model has none: this run trains without it. .*"
                     r"model.hf_class=auto", said[0])
    (tmp_path / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.0, "resid_pdrop": 0.0}))
    resolve_init_from(ModelConfig(init_from=str(tmp_path)), said.append)
    assert len(said) == 1  # a modern base's 0.0: nothing to say
