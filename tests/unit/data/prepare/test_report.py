"""The prepare report: every drop counted by reason, files passed over, the printed table and report.json agree."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kiln.config import DataConfig
from kiln.data.prepare.pipeline import prepare
from kiln.data.prepare.tokenizer import train_bpe


def test_report_counts_each_reason_and_matches_what_is_printed(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    good = [f"document number {i} with some words" for i in range(40)]
    bad = ['{"title": "x"}', '{"text": 5}', '{"text": "  "}', '{"text": "' + "y" * 300 + '"}', '{"text": "ab"}',
           '{"text": "' + "z" * 150 + '"}', "{not json"]
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in good) + "\n".join(bad) + "\n")
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in good[:3]))  # duplicates
    (d / "NOTES").write_text("not data")
    train_bpe(good, 300).save(tmp_path / "tokenizer.json")
    cfg = DataConfig(sources=[str(d)], tokenizer=str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "c"),
                     on_bad_record="skip", max_record_bytes=200, min_chars=3, max_chars=100, val_fraction=0,
                     workers=1)
    console = Console(record=True, width=200)
    ds = prepare(cfg, console)
    report = json.loads((ds.path / "report.json").read_text())
    assert report["dropped"] == {"duplicate": 3, "empty": 1, "long": 1, "malformed": 1, "missing_field": 1,
                                 "short": 1, "too_long": 1, "wrong_type": 1}
    assert report["documents"] == 40 and report["documents_read"] == 40 + 3  # duplicates are read, then dropped
    assert report["files"] == 2 and report["files_passed_over"] == 1
    assert report["dropped_examples"]["wrong_type"] == [f"{d / 'a.jsonl'}:42"]
    assert report == ds.manifest["report"]
    printed = console.export_text()
    for reason, n in report["dropped"].items():
        assert f"dropped: {reason}" in printed and f" {n} (record " in printed
    assert "1 file(s) in source directories not read" in printed and str(d / "NOTES") in printed


def test_damaged_files_under_skip_are_named_in_the_report_and_prepare_goes_on(tmp_path):
    from kiln.errors import DataError

    from ..read.test_sources import _damaged_files

    names = _damaged_files(tmp_path)
    train_bpe(["record 1 xxxx", "a good document"], 300).save(tmp_path / "tokenizer.json")
    cfg = DataConfig(sources=[str(tmp_path / n) for n in names], tokenizer=str(tmp_path / "tokenizer.json"),
                     cache_dir=str(tmp_path / "c"), on_bad_record="skip", val_fraction=0, workers=1)
    console = Console(record=True, width=300)
    report = prepare(cfg, console).manifest["report"]
    assert report["dropped"] == {"damaged_file": 3}
    assert report["dropped_examples"]["damaged_file"] == [str(tmp_path / n) for n in names[:3]]
    assert 1 < report["documents"] < 2 * 200 + 1
    printed = console.export_text()
    assert "3 file(s) could not be read to their end" in printed and str(tmp_path / "fake.parquet") in printed
    with pytest.raises(DataError, match="cut.jsonl.gz: cannot read"):
        prepare(cfg.model_copy(update={"on_bad_record": "error"}))


def test_text_a_tokenizer_has_no_token_for_is_counted_as_its_unknown_token(tmp_path):
    """A WordPiece tokenizer (no byte fallback) turned Greek and emoji into [UNK] without a word: lost text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["hello world good doc"] * 10, trainers.WordPieceTrainer(vocab_size=100,
                                                                                      special_tokens=["[UNK]", "</s>"]))
    tk.save(str(tmp_path / "wp.json"))
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "ελληνικά κείμενο 😀"}\n')
    cfg = DataConfig(sources=[str(tmp_path / "a.jsonl")], tokenizer=str(tmp_path / "wp.json"), val_fraction=0,
                     workers=1, cache_dir=str(tmp_path / "c"))
    console = Console(record=True, width=300)
    report = prepare(cfg, console).manifest["report"]
    assert report["unknown_tokens"] == 3 and report["unknown_token"] == "[UNK]"  # one per word: 3 of 7 tokens
    assert "3 tokens (42.86%) are the tokenizer's unknown token [UNK]" in console.export_text()
    own = prepare(cfg.model_copy(update={"tokenizer": None, "vocab_size": 300})).manifest["report"]
    assert "unknown_tokens" not in own  # a byte-level BPE has no unknown token: nothing is lost, nothing counted
