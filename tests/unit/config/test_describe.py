"""`kiln train --help-config` and the config reference read each key's type, bounds and default as YAML has them."""

from kiln.config import RunConfig, describe_fields
from kiln.config.describe import default_text, keys, type_name


def _line(text: str, key: str) -> str:
    found = [line for line in text.splitlines() if line.strip().startswith(f"{key} (")]
    assert len(found) == 1, f"{key}: {found}"
    return found[0]


def test_types_and_defaults_read_as_yaml():
    text = describe_fields()
    assert _line(text, "train.batch_size").strip().startswith("train.batch_size (int or auto, default 8): ")
    assert "(llama, mistral, qwen2, nemotron, " in _line(text, "model.hf_model_type")  # a literal's choices, listed
    assert " or null, default null)" in _line(text, "model.hf_model_type")
    assert "(bool, default true)" in _line(text, "model.tie_embeddings")
    assert "(float, > 0, <= 1, default 0.002): Peak learning rate" in _line(text, "train.lr")
    assert '(list of str, default ["@stdlib"])' in _line(text, "data.sources")


def test_nested_sections_list_their_keys_below_them():
    text = describe_fields()
    assert _line(text, "train.early_stop").strip().startswith("train.early_stop (section): ")
    assert _line(text, "train.early_stop.patience").startswith("    train.early_stop.patience (int, >= 0, default 0)")
    assert _line(text, "model.rope_scaling.factor").startswith("    model.rope_scaling.factor (float, default 8.0)")
    assert "(list of entries, default [])" in _line(text, "data.mixture")
    assert _line(text, "weight").startswith("    weight (float, > 0, default 1.0)")  # each entry of data.mixture


def test_one_line_per_key_and_every_key_documented():
    lines = describe_fields().splitlines()
    top = [k.name for k in keys(RunConfig)]
    count = sum(1 for line in lines if not line.startswith(" "))
    assert count == len(top)  # a docstring's line breaks never start a line of their own
    assert all(not line.rstrip().endswith(":") for line in lines)


def test_type_name_quotes_choices_on_request():
    train = RunConfig.model_fields["train"].annotation
    schedule = train.model_fields["schedule"]
    assert type_name(schedule.annotation) == "cosine, wsd or constant"
    assert type_name(schedule.annotation, quote="`") == "`cosine`, `wsd` or `constant`"
    assert default_text(train.model_fields["global_batch_tokens"]) == "null"


def test_limits_inside_a_list_and_keys_without_a_default():
    text = describe_fields()
    assert _line(text, "weights").strip().startswith("weights (list of float >= 0, required): ")  # data.schedule
    assert _line(text, "at").strip().startswith("at (int, >= 0, required): ")
