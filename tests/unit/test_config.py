from pathlib import Path

import pytest

from kiln.config import RunConfig, describe_fields, load_config
from kiln.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_are_valid_and_round_trip(tmp_path):
    cfg = load_config()
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_yaml_and_dotted_overrides(tmp_path):
    p = write(tmp_path, "train:\n  lr: 1.0e-3\n  max_steps: 50\nmodel:\n  n_layers: 2\n")
    cfg = load_config(p, ["train.lr=3e-4", "model.n_layers=4", "model.tie_embeddings=false", "data.sources=[a.txt, b.txt]"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.max_steps == 50
    assert cfg.model.n_layers == 4
    assert cfg.model.tie_embeddings is False
    assert cfg.data.sources == ["a.txt", "b.txt"]


def test_unknown_key_names_path_and_suggests(tmp_path):
    p = write(tmp_path, "train:\n  max_stpes: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "train.max_stpes" in msg and "did you mean 'train.max_steps'" in msg
    assert str(p) in msg


def test_every_problem_is_reported_at_once(tmp_path):
    p = write(tmp_path, "train:\n  lr: fast\n  batch_sise: 4\nmodel:\n  n_layers: many\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["optim.beta1=[1]", "nonsense"])
    msg = str(e.value)
    assert "5 problem(s)" in msg
    for part in ("train.lr", "'fast'", "train.batch_sise", "model.n_layers", "'many'", "optim.beta1", "'nonsense'"):
        assert part in msg


def test_bad_yaml_reports_line(tmp_path):
    p = write(tmp_path, "train:\n  lr: 1\n   max_steps: [\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:\d+:\d+: not valid YAML"):
        load_config(p)


def test_non_mapping_yaml(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_file_and_presets():
    with pytest.raises(ConfigError, match="does not exist and is not a preset"):
        load_config("no-such-file.yaml")
    cfg = load_config("quickstart")
    assert cfg.model.d_model == RunConfig().model.d_model


def test_every_preset_loads():
    from kiln.config import PRESETS_DIR

    names = [p.stem for p in PRESETS_DIR.glob("*.yaml")]
    assert {"quickstart", "gpu-124m", "gpu-1b"} <= set(names)
    for name in names:
        load_config(name)


def test_model_size_fills_fields_and_explicit_fields_win():
    cfg = load_config(None, ["model.size=124m", "model.n_layers=6"])
    assert cfg.model.d_model == 768 and cfg.model.vocab_size == 32000
    assert cfg.model.n_layers == 6


def test_every_field_is_documented():
    text = describe_fields()
    for line in text.splitlines():
        assert not line.rstrip().endswith(":"), f"undocumented: {line}"
    assert "train.lr" in text


def test_a_single_source_string_is_a_list_of_one():
    assert load_config(None, ["data.sources=corpus.jsonl"]).data.sources == ["corpus.jsonl"]


BAD_OVERRIDES = {  # name: (overrides, what the error must say)
    "key_in_wrong_section_points_to_the_right_one": (["train.weight_decay=0.1"], "did you mean 'optim.weight_decay'"),
    "unknown_section_suggests": (["optimm.beta1=0.9"], "did you mean 'optim'"),
    "unknown_size_suggests": (["model.size=124M"], "did you mean '124m'"),
    "width_not_divisible_by_heads": (["model.d_model=100", "model.n_heads=3"], "not divisible by n_heads"),
    "heads_not_divisible_by_kv_heads": (["model.n_heads=4", "model.n_kv_heads=3"], "n_kv_heads"),
    "literal_choices_are_checked": (["train.schedule=linear"], "train.schedule"),
    "override_into_a_value": (["train.lr.peak=1"], "is a value, not a section"),
    "sequence_longer_than_the_model": (["train.seq_len=4096"],
                                       "train.seq_len=4096 is longer than model.max_seq_len=2048"),
    "yaml_colon_without_space": (["data.mixture=[{sources: [a.jsonl], weight:0.5}]"],
                                 "YAML needs a space after the colon: 'weight: 0.5'"),
    "typo_in_a_list_item_suggests": (["data.mixture=[{sources: [a.jsonl], wieght: 1}]"],
                                     "did you mean 'data.mixture.0.weight'"),
    "no_sources": (["data.sources=[]"], "data.sources is empty"),
    "sources_and_mixture_both_given": (["data.sources=[a.txt]", "data.mixture=[{sources: [b.txt]}]"],
                                       "either data.sources or data.mixture"),
}


def test_an_override_of_sources_or_mixture_replaces_the_files_other():
    cfg = load_config("quickstart", ["data.mixture=[{sources: [a.jsonl], weight: 2}, {sources: [b.jsonl]}]"])
    assert [e.sources for e in cfg.data.mixture] == [["a.jsonl"], ["b.jsonl"]]
    with pytest.raises(ConfigError, match="either data.sources or data.mixture"):
        load_config("quickstart", ["data.mixture=[{sources: [a.jsonl]}]", "data.sources=[b.jsonl]"])


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES.values(), ids=BAD_OVERRIDES.keys())
def test_bad_override_is_a_config_error_that_says_why(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
