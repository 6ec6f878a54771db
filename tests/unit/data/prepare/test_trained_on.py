"""A resumed run keeps the dataset it trained on when a Kiln upgrade's readers would name it anew."""

from __future__ import annotations

import io
import sysconfig
from pathlib import Path

from rich.console import Console

from kiln.config import DataConfig
from kiln.data.prepare import keys
from kiln.data.prepare.pipeline import prepare
from kiln.data.prepare.tokenizer import train_bpe


def test_a_resumed_run_keeps_the_dataset_an_earlier_reader_made_of_the_same_files(tmp_path, monkeypatch):
    """After READERS_VERSION changed, a run's own files were prepared again under another id and its checkpoint
    was refused, with --resume force too: a run started before an upgrade could not go on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [(stdlib / n).read_text() for n in ("textwrap.py", "shlex.py", "bisect.py")]
    for i, t in enumerate(texts):
        (corpus / f"{i}.txt").write_text(t)
    train_bpe(texts, 300).save(tmp_path / "tokenizer.json")
    cfg = DataConfig(sources=[str(corpus)], tokenizer=str(tmp_path / "tokenizer.json"),
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.2, workers=1)
    old = prepare(cfg)
    monkeypatch.setattr(keys, "READERS_VERSION", keys.READERS_VERSION + 1)  # the readers of a newer Kiln
    new = prepare(cfg)
    assert new.id != old.id  # a new run reads with the new readers
    said = io.StringIO()
    kept = prepare(cfg, Console(file=said), trained_on=old.id)
    assert kept.path == old.path  # the resumed one goes on with what it trained on, and says so
    assert "(the dataset this run trained on, made of the same files by an earlier Kiln's readers)" in " ".join(
        said.getvalue().split())  # the report's title, wrapped at the table's width
    (corpus / "0.txt").write_text(texts[0] + "\n# changed\n")  # other files: not its data any more
    assert prepare(cfg, trained_on=old.id).id not in (old.id, new.id)


def test_a_resumed_mixture_run_keeps_each_entrys_dataset(tmp_path, monkeypatch):
    """A data.mixture run is fingerprinted by the set of its entries' datasets: after an upgrade each entry was
    prepared anew and the run's checkpoint refused, as a data.sources run's was before trained_on."""
    from kiln.data.build import RunData, prepare_all

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text() for n in ("textwrap.py", "shlex.py", "bisect.py", "colorsys.py")]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t)
    train_bpe(texts, 300).save(tmp_path / "tokenizer.json")
    cfg = DataConfig(mixture=[{"sources": [str(tmp_path / "0.txt"), str(tmp_path / "1.txt")], "weight": 2},
                              {"sources": [str(tmp_path / "2.txt"), str(tmp_path / "3.txt")], "weight": 1}],
                     tokenizer=str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"),
                     val_fraction=0.2, workers=1)
    old = RunData(None, None, None, prepare_all(cfg))
    saved = {"dataset": old.manifest["id"], "datasets": [ds.id for ds in old.datasets]}  # a checkpoint's record
    monkeypatch.setattr(keys, "READERS_VERSION", keys.READERS_VERSION + 1)
    assert RunData(None, None, None, prepare_all(cfg)).manifest["id"] != saved["dataset"]
    for trained_on in (saved["datasets"], saved["dataset"]):  # as saved now, and by a Kiln before the entries' ids
        kept = RunData(None, None, None, prepare_all(cfg, trained_on=trained_on))
        assert kept.manifest["id"] == saved["dataset"]
        assert [ds.path for ds in kept.datasets] == [ds.path for ds in old.datasets]


def test_a_resumed_run_keeps_the_tokenizer_kiln_trained_for_it(tmp_path, monkeypatch):
    """A BPE trained by `kiln prepare` is cached under the readers' version too: after an upgrade whose readers
    give other documents, it was trained anew, another tokenizer, so the run's own dataset (made with the old one)
    was not found and the checkpoint was refused for its tokenizer."""
    from kiln.data.prepare import pipeline

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for n in ("textwrap.py", "shlex.py"):
        (tmp_path / n).write_text((stdlib / n).read_text())
    cfg = DataConfig(sources=[str(tmp_path / "textwrap.py"), str(tmp_path / "shlex.py")], vocab_size=300,
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.2, workers=1)
    old = prepare(cfg)
    monkeypatch.setattr(keys, "READERS_VERSION", keys.READERS_VERSION + 1)
    real = pipeline._train_texts
    monkeypatch.setattr(pipeline, "_train_texts", lambda *a: (t.upper() for t in real(*a)))  # the new readers' text
    assert prepare(cfg).tokenizer.hash != old.tokenizer.hash  # a new run trains its own
    kept = prepare(cfg, trained_on=old.id)
    assert kept.path == old.path and kept.tokenizer.hash == old.tokenizer.hash
