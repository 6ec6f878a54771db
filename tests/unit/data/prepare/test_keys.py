"""Cache keys: every key (dataset id, trained tokenizer, streaming tokenizer) follows every reading setting."""

from __future__ import annotations

import pytest

from kiln.config import DataConfig
from kiln.data.load.streaming import streaming_tokenizer
from kiln.data.prepare.keys import dataset_settings, read_settings, tokenizer_key
from kiln.data.prepare.pipeline import prepare
from kiln.data.prepare.tokenizer import train_bpe
from kiln.errors import DataError

OTHER = {"format": "jsonl", "text_unit": "line", "field": "body", "csv_quoting": False, "dataset_split": "test",
         "max_record_bytes": 1000, "min_chars": 3, "max_chars": 900, "on_bad_record": "skip"}


class Tok:
    eos_id, bos_id = 0, None


def test_every_reading_setting_changes_every_key():
    cfg = DataConfig(sources=["x.jsonl"])
    assert set(read_settings(cfg)) == {"readers", *OTHER}  # a new setting is named here, with a changed value
    for name, value in OTHER.items():
        other = cfg.model_copy(update={name: value})
        assert tokenizer_key(other, ["sha"]) != tokenizer_key(cfg, ["sha"]), name
        assert tokenizer_key(other, ["stream", "k"]) != tokenizer_key(cfg, ["stream", "k"]), name
        assert dataset_settings(other, Tok) != dataset_settings(cfg, Tok), name


def test_streaming_tokenizer_is_trained_again_when_a_filter_changes(tmp_path):
    """The streaming tokenizer's key left out data.min_chars, max_chars and max_record_bytes: a tokenizer
    trained on other documents was reused."""
    src = tmp_path / "a.jsonl"
    src.write_text("".join(f'{{"text": "document {i} {"x" * (i % 50)}"}}\n' for i in range(200)))
    cfg = DataConfig(sources=[str(src)], vocab_size=300, cache_dir=str(tmp_path / "cache"))
    updates = [{}, {"min_chars": 20}, {"max_chars": 30}, {"on_bad_record": "skip"},
               {"on_bad_record": "skip", "max_record_bytes": 40}]
    for update in updates:
        streaming_tokenizer(cfg.model_copy(update=update))
    assert len(list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*"))) == len(updates)


def test_a_dataset_prepared_with_skip_is_not_reused_under_error(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(50)) + '{"txt": "no text"}\n')
    train_bpe([f"document number {i}" for i in range(50)], 300).save(tmp_path / "tok.json")
    cfg = DataConfig(sources=[str(src)], tokenizer=str(tmp_path / "tok.json"), cache_dir=str(tmp_path / "cache"),
                     val_fraction=0, on_bad_record="skip")
    assert prepare(cfg).manifest["report"]["dropped"] == {"missing_field": 1}
    with pytest.raises(DataError, match=r"a.jsonl:51: the record has no text field"):
        prepare(cfg.model_copy(update={"on_bad_record": "error"}))
