"""kiln generate samples with the options given, else the model's generation_config.json, else Kiln's defaults."""

import json

import pytest

from kiln.errors import ConfigError
from kiln.state.sampling import KILN_DEFAULTS, sampling_settings

NONE = dict.fromkeys(("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens"))


def model(tmp_path, **generation):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **generation}))
    return tmp_path


def test_the_models_settings_are_used_and_the_options_given_win(tmp_path):
    path = model(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1, max_new_tokens=7)
    s = sampling_settings(path, **NONE)
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.max_new_tokens) == (0.6, 50, 0.9, 1.1, 7)
    assert s.source == path / "generation_config.json"
    given = sampling_settings(path, **{**NONE, "temperature": 0.0, "max_new_tokens": 3})
    assert (given.temperature, given.top_p, given.max_new_tokens) == (0.0, 0.9, 3)


def test_do_sample_false_is_greedy_and_a_file_without_settings_leaves_kilns(tmp_path):
    assert sampling_settings(model(tmp_path / "a", do_sample=False, temperature=0.7), **NONE).temperature == 0
    plain = sampling_settings(model(tmp_path / "b"), **NONE)  # a Kiln export of a model trained from scratch
    assert plain._asdict() == {**KILN_DEFAULTS, "source": None}


def test_a_run_reads_its_init_from_directory(tmp_path):
    source = model(tmp_path / "src", top_k=20)
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "model_config.json").write_text(json.dumps({"init_from": str(source)}))
    assert sampling_settings(tmp_path / "run", **NONE).top_k == 20


def test_a_run_whose_init_from_directory_is_gone_reads_its_copy(tmp_path):
    """model.init_from moved away since the run: kiln generate RUN sampled with Kiln's defaults, not the model's."""
    from kiln.config import ModelConfig
    from kiln.state.hf_source import keep_source

    source = model(tmp_path / "src", top_k=20)
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "model_config.json").write_text(json.dumps({"init_from": str(source)}))
    keep_source(ModelConfig(init_from=str(source)), tmp_path / "run")  # as kiln train does at its start
    source.rename(tmp_path / "moved")
    assert sampling_settings(tmp_path / "run", **NONE).top_k == 20


def test_a_setting_transformers_would_refuse_names_the_file(tmp_path):
    path = model(tmp_path, top_p=1.5)
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p 1.5 .*--top-p"):
        sampling_settings(path, **NONE)
    assert sampling_settings(path, **{**NONE, "top_p": 0.5}).top_p == 0.5  # the option given replaces it


def test_the_sample_at_the_end_of_a_run_samples_as_its_init_froms_generation_config(tmp_path):
    from kiln.config import RunConfig
    from kiln.state.sampling import run_sampling

    source = model(tmp_path / "src", do_sample=False, top_k=20, max_new_tokens=5)
    cfg = RunConfig.model_validate({"model": {"init_from": str(source)}})
    assert run_sampling(cfg) == {"temperature": 0.0, "top_k": 20, "top_p": 1.0, "repetition_penalty": 1.0}
    (source / "generation_config.json").write_text('{"top_p": 7}')  # refused by kiln generate; here Kiln's
    assert run_sampling(cfg)["temperature"] == 0.8 and run_sampling(RunConfig())["top_k"] == 50
