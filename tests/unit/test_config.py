from pathlib import Path

import pytest

from kiln.config import RunConfig, derive, describe_fields, load_config
from kiln.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_are_valid_and_round_trip(tmp_path):
    cfg = load_config()
    again = load_config(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize("batch", ["4", "auto"])
def test_a_run_config_with_global_batch_tokens_round_trips(tmp_path, batch):
    """A run's config.yaml records train.grad_accum (1): loading it back, as `kiln train RUN_DIR` does to resume,
    is no conflict with train.global_batch_tokens. Another grad_accum still is."""
    cfg = load_config(None, [f"train.batch_size={batch}", "train.global_batch_tokens=8192"])
    assert load_config(write(tmp_path, cfg.to_yaml())) == cfg
    with pytest.raises(ConfigError, match="not both"):
        load_config(write(tmp_path, cfg.to_yaml()), ["train.grad_accum=2"])



def test_early_stopping_without_evaluations_during_training_is_a_config_error():
    """train.early_stop counts the evaluations of train.eval_every; with none it would never stop a run."""
    with pytest.raises(ConfigError, match=r"patience=2 counts evaluations during training, and train.eval_every=0"):
        load_config(None, ["train.eval_every=0", "train.early_stop.patience=2"])
    assert load_config(None, ["train.eval_every=0"]).train.early_stop.patience == 0
    assert load_config(None, ["train.eval_every=5", "train.early_stop.patience=2"]).train.early_stop.patience == 2

def test_yaml_and_dotted_overrides(tmp_path):
    p = write(tmp_path, "train:\n  lr: 1.0e-3\n  max_steps: 50\nmodel:\n  n_layers: 2\n")
    cfg = load_config(p, ["train.lr=3e-4", "model.n_layers=4", "model.tie_embeddings=false",
                          "data.sources=[a.txt, b.txt]"])
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


def test_a_key_given_twice_in_yaml_is_named_with_both_lines(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.yaml:3:3: .*key 'seq_len' given twice \(first at line 2\)"):
        load_config(write(tmp_path, "train:\n  seq_len: 32\n  seq_len: 64\n"))
    with pytest.raises(ConfigError, match="key 'train' given twice"):
        load_config(write(tmp_path, "train:\n  lr: 0.1\nmodel:\n  d_model: 64\ntrain:\n  seq_len: 64\n"))
    # a merge key's values may be overridden beside it: no key is given twice there
    cfg = load_config(write(tmp_path, "data:\n  mixture:\n    - &e {sources: [a.jsonl], weight: 1}\n"
                                      "    - {<<: *e, weight: 2}\n"))
    assert [e.weight for e in cfg.data.mixture] == [1, 2]


def test_a_config_that_is_not_yaml_text_is_a_config_error(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_bytes(b"train:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match="run.yaml: not a text file in UTF-8"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_config(tmp_path)


def test_non_mapping_yaml(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_file_and_presets():
    with pytest.raises(ConfigError, match="does not exist and is not a preset. Presets: "):
        load_config("no-such-file.yaml")
    with pytest.raises(ConfigError, match="'gpu-125m' does not exist and is not a preset. Did you mean 'gpu-124m'?"):
        load_config("gpu-125m")
    cfg = load_config("quickstart")
    assert cfg.model.d_model == RunConfig().model.d_model


def test_every_preset_loads():
    from kiln.config import PRESETS_DIR

    names = [p.stem for p in PRESETS_DIR.glob("*.yaml")]
    assert {"quickstart", "gpu-124m", "gpu-1b", "cpt-8b-1gpu", "cpt-8b-4gpu"} <= set(names)
    for name in names:
        load_config(name)


def test_model_size_fills_fields_and_explicit_fields_win():
    cfg = load_config(None, ["model.size=124m", "model.n_layers=6"])
    assert cfg.model.d_model == 768 and cfg.model.vocab_size == 32000
    assert cfg.model.n_layers == 6


def test_a_size_given_as_an_override_replaces_the_shape_of_the_config_file():
    """quickstart writes its shape out (d_model 256, 4 layers): `model.size=tiny` on it trained that shape."""
    from kiln.sizes import SIZES

    cfg = load_config("quickstart", ["model.size=tiny"])
    assert (cfg.model.d_model, cfg.model.n_layers) == (SIZES["tiny"]["d_model"], SIZES["tiny"]["n_layers"])
    assert load_config("quickstart", ["model.size=tiny", "model.n_layers=3"]).model.n_layers == 3
    assert load_config("quickstart").model.d_model == 256  # the file's own shape, without a size override


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
    # an unset shell variable ($CACHE) gives '': read as a path it is the current directory
    "empty_cache_dir": (["data.cache_dir="], "data.cache_dir: empty; give a value, or leave the key out"),
    "empty_eos_token": (["data.eos_token="], "data.eos_token: empty"),
    "blank_field": (["data.field= "], "data.field: empty"),
    "empty_tokenizer": (["data.tokenizer=''"], r"data.tokenizer: empty; .* default \(null\)"),
    "empty_source": (["data.sources=[a.txt, '']"], "data.sources.1: an empty source"),
    "empty_mixture_source": (["data.mixture=[{sources: ['']}]"], "data.mixture.0.sources.0: an empty source"),
    "no_mixture_sources": (["data.mixture=[{sources: []}]"], "data.mixture.0: the entry's sources are empty"),
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


DOZEN_MISTAKES = """\
model:
  d_model: 100
  n_heads: 3
  n_layrs: 2
  norm_eps: -1
  max_seq_len: 128
data:
  vocab_size: 100
  val_fraction: 1.5
  min_chars: 50
  max_chars: 10
  fromat: jsonl
train:
  seq_len: 256
  lr: -1
  batch_size: 0
  schedule: linear
  device: gpu
  threads: 0
optim:
  beta2: 1.5
checkpoint:
  keep_last: 0
logging:
  every: often
"""


def test_a_dozen_mistakes_across_sections_come_out_in_one_error(tmp_path):
    """Bounds, types, unknown keys and cross-field checks of every section, all at once (no rounds)."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, DOZEN_MISTAKES))
    msg = str(e.value)
    expected = [
        "model.norm_eps: Input should be greater than 0",
        "model.n_layrs: unknown key; did you mean 'model.n_layers'?",
        "d_model=100 is not divisible by n_heads=3",
        "data.val_fraction: Input should be less than 1",
        "data.fromat: unknown key; did you mean 'data.format'?",
        "data.max_chars=10 is below data.min_chars=50",
        "data.vocab_size=100 is too small for the byte-level BPE trained here: it needs at least 257",
        "train.batch_size: Input should be greater than or equal to 1 (got 0)",
        "train.lr: Input should be greater than 0 (got -1)",
        "train.schedule: Input should be 'cosine', 'wsd' or 'constant'",
        "train.device: not a device",
        "train.threads: Input should be greater than or equal to 1",
        "train.seq_len=256 is longer than model.max_seq_len=128",
        "optim.beta2: Input should be less than 1",
        "checkpoint.keep_last: Input should be greater than or equal to 1",
        "logging.every: Input should be a valid integer",
    ]
    for part in expected:
        assert part in msg, part
    assert f"{len(expected)} problem(s)" in msg
    assert msg.index("model.norm_eps") < msg.index("data.fromat") < msg.index("train.lr") < msg.index("logging.every")


def test_a_cross_field_check_is_skipped_when_one_of_its_fields_is_itself_wrong():
    """A bad value is reported once, not again through a check that read its default instead."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.max_seq_len=zero", "train.seq_len=4096"])
    msg = str(e.value)
    assert "1 problem(s)" in msg and "model.max_seq_len" in msg and "longer than" not in msg


@pytest.mark.parametrize("override,message", [
    ("train.lr=-1", "train.lr: Input should be greater than 0"),
    ("train.lr=5", "train.lr: Input should be less than or equal to 1"),
    ("train.batch_size=0", "train.batch_size: Input should be greater than or equal to 1"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.seq_len=0", "train.seq_len"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("train.seed=-3", "train.seed"),
    ("model.n_layers=0", "model.n_layers"),
    ("model.n_heads=0", "model.n_heads"),
    ("model.vocab_size=0", "model.vocab_size"),
    ("data.workers=0", "data.workers"),
    ("data.prefetch=-1", "data.prefetch"),
    ("data.mixture=[{sources: [a.txt], weight: 0}]", "data.mixture.0.weight: Input should be greater than 0"),
    ("optim.eps=0", "optim.eps"),
    ("checkpoint.write_threads=0", "checkpoint.write_threads"),
    ("logging.every=0", "logging.every"),
])
def test_numeric_bounds_are_config_errors(override, message):
    with pytest.raises(ConfigError, match="1 problem") as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_vocab_checks_know_which_tokenizer_is_trained():
    with pytest.raises(ConfigError, match="needs at least 258"):  # EOS and a BOS of its own
        load_config(None, ["data.vocab_size=257", "data.bos_token=auto"])
    assert load_config(None, ["data.vocab_size=257"]).data.vocab_size == 257
    assert load_config(None, ["data.vocab_size=100", "data.tokenizer=tok.json"]).data.tokenizer == "tok.json"


def test_the_checks_still_hold_for_configs_built_in_code():
    from pydantic import ValidationError

    from kiln.config import DataConfig, ModelConfig

    with pytest.raises(ValidationError, match="not divisible by n_heads"):
        ModelConfig(d_model=100, n_heads=3)
    with pytest.raises(ValidationError, match="too small for the byte-level BPE"):
        DataConfig(vocab_size=10)
    with pytest.raises(ValidationError, match="longer than model.max_seq_len"):
        RunConfig.model_validate({"train": {"seq_len": 4096}})
    cfg = RunConfig()
    with pytest.raises(ValidationError, match="frozen"):  # a validated config is never changed in place
        cfg.train.batch_size = 0
    with pytest.raises(ConfigError, match="greater than or equal to 1"):  # derive() validates the new one
        derive(cfg, {"train.batch_size": 0})


@pytest.mark.parametrize("override,value", [
    ("train.sample_prompt=The ", "The "),  # the shell has already removed the quotes of "The "
    ("train.sample_prompt=  x = 1  # note", "  x = 1  # note"),
    ("train.sample_prompt=Q: ", "Q: "),
    ("train.sample_prompt='The '", "The "),
    ("train.sample_prompt=123", "123"),
    ("train.sample_prompt=", ""),
])
def test_a_text_override_is_kept_exactly(override, value):
    assert load_config(None, [override]).train.sample_prompt == value


def test_a_nullable_text_override_still_takes_null():
    assert load_config(None, ["data.bos_token=null"]).data.bos_token is None
    assert load_config(None, ["data.bos_token=auto"]).data.bos_token == "auto"
    assert load_config(None, ["train.run_dir=2024"]).train.run_dir == "2024"


def test_a_relative_cache_dir_is_made_absolute_once_so_a_resume_elsewhere_finds_it(tmp_path, monkeypatch):
    """`data.cache_dir: cache` was kept relative in the run's config.yaml: `kiln train RUN_DIR` from another
    directory trained the tokenizer and prepared the data again into a new cache there."""
    import yaml

    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cfg = load_config(None, ["data.cache_dir=cache"])
    assert cfg.data.cache_dir == str(tmp_path / "a" / "cache")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))  # as a run saves it
    monkeypatch.chdir(tmp_path)
    assert load_config(str(tmp_path / "config.yaml")).data.cache_dir == str(tmp_path / "a" / "cache")
    assert load_config(None, ["data.cache_dir=~/kc"]).data.cache_dir == "~/kc"  # the same wherever it runs


def test_lora_targets_read_mixtrals_expert_names():
    """Mixtral's expert projections are w1 (gate), w3 (up) and w2 (down), as its PEFT and axolotl configs name
    them; lora.targets refused them as unknown."""
    from kiln.config import LoraConfig

    assert LoraConfig(rank=4, targets=["q_proj", "w1", "w2", "w3"]).targets == ["q", "gate", "down", "up"]
