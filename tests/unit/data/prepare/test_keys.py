"""Cache keys: every key (dataset id, trained tokenizer, streaming tokenizer) follows every reading setting, and
how a file's name says it is read (its format and compression by suffix)."""

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
        assert dataset_settings(other, Tok, []) != dataset_settings(cfg, Tok, []), name


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


def jsonl_corpus(path):
    path.write_text("".join(f'{{"text": "record {i}: {"word " * (i % 7)}done"}}\n' for i in range(200)))
    return path


@pytest.mark.parametrize("own_tokenizer", [True, False], ids=["given tokenizer", "trained tokenizer"])
def test_a_file_renamed_to_another_format_is_prepared_again(tmp_path, own_tokenizer):
    """JSON lines named corpus.txt are one text document; renamed corpus.jsonl, the same bytes are 200 records.
    The renamed file's dataset was the stale one-document dataset of the .txt (same bytes, same settings)."""
    src = jsonl_corpus(tmp_path / "corpus.txt")
    tok = {}
    if own_tokenizer:
        train_bpe([src.read_text()], 300).save(tmp_path / "tok.json")
        tok = {"tokenizer": str(tmp_path / "tok.json")}
    cfg = DataConfig(sources=[str(src)], vocab_size=300, cache_dir=str(tmp_path / "cache"), val_fraction=0, **tok)
    as_text = prepare(cfg)
    assert as_text.manifest["report"]["documents"] == 1
    renamed = src.rename(tmp_path / "corpus.jsonl")
    as_jsonl = prepare(cfg.model_copy(update={"sources": [str(renamed)]}))
    assert as_jsonl.manifest["report"]["documents"] == 200
    assert as_jsonl.manifest["id"] != as_text.manifest["id"]
    assert as_jsonl.manifest["settings"]["reads"] == ["jsonl"] and as_text.manifest["settings"]["reads"] == ["text"]
    if not own_tokenizer:  # the BPE learnt from the JSON syntax is not reused for the records' text
        assert len(list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*"))) == 2


def test_a_gzip_file_renamed_without_its_suffix_is_prepared_again(tmp_path):
    import gzip

    train_bpe(["record done word"] * 10, 300).save(tmp_path / "tok.json")
    data = "".join(f"line {i} of the text\n" for i in range(100)).encode()
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(data, mtime=0))
    cfg = DataConfig(sources=[str(tmp_path / "a.txt.gz")], tokenizer=str(tmp_path / "tok.json"),
                     cache_dir=str(tmp_path / "cache"), val_fraction=0, on_bad_record="skip")
    first = prepare(cfg)
    assert first.manifest["settings"]["reads"] == ["text+gzip"] and first.manifest["report"]["documents"] == 1
    (tmp_path / "a.txt.gz").rename(tmp_path / "a.txt")  # compressed bytes read as text now: not the same dataset
    with pytest.raises(DataError, match="0 documents read; dropped: 1 damaged_file"):
        prepare(cfg.model_copy(update={"sources": [str(tmp_path / "a.txt")]}))

