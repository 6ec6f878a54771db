"""Streaming mode: documents tokenized on the fly, resumable at the same document and offset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.config import DataConfig
from kiln.data.load.streaming import StreamingLoader, streaming_tokenizer
from kiln.errors import DataError

T, B = 32, 2


@pytest.fixture
def corpus(tmp_path):
    """Two JSONL files and a text file of short documents (sentences of stdlib docstrings)."""
    import collections
    import json as json_mod
    import pathlib

    texts = [line.strip() for mod in (collections, json_mod, pathlib)
             for line in (mod.__doc__ or "").splitlines() if len(line.strip()) > 20]
    texts = (texts * 3)[:120]
    src = tmp_path / "src"
    src.mkdir()
    for i, chunk in enumerate((texts[:50], texts[50:90])):
        with open(src / f"part{i}.jsonl", "w") as f:
            for j, t in enumerate(chunk):
                f.write(json.dumps({"text": f"{j}: {t}"}) + "\n")
    (src / "part2.txt").write_text("\n".join(f"line {j}: {t}" for j, t in enumerate(texts[90:])))
    cfg = DataConfig(sources=[str(src / "*.jsonl"), str(src / "*.txt")], text_unit="line", vocab_size=300,
                     val_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"), max_bytes=None, dedup=False)
    return cfg, streaming_tokenizer(cfg)


def loader(cfg, tok, split="train", **kw):
    kw.setdefault("prefetch", 0)
    return StreamingLoader(cfg, tok, split, T, kw.pop("batch_size", B), seed=1, **kw)


def take(ld, n):
    return [next(ld) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))


def test_rows_follow_the_documents_in_order(corpus):
    cfg, tok = corpus
    cfg = cfg.model_copy(update={"shuffle": False})
    from kiln.data.read.records import doc_hash, is_val
    from kiln.data.read.sources import iter_documents

    docs = [d.text for d in iter_documents(cfg) if not is_val(doc_hash(d.text), cfg.val_fraction)]
    stream = np.concatenate([tok.encode(t) + [tok.eos_id] for t in docs])
    batches = take(loader(cfg, tok), 3)
    flat = np.concatenate([np.concatenate([b[0].numpy().ravel()]) for b in batches])
    np.testing.assert_array_equal(flat, stream[:flat.size])
    tokens, targets, doc_ids = batches[0]
    np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
    after_eos = (tokens[:, :-1] == tok.eos_id).int()
    np.testing.assert_array_equal(torch.diff(doc_ids, dim=1), after_eos)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume_across_epochs(corpus, prefetch):
    cfg, tok = corpus
    n = 100  # more than an epoch of this corpus
    full = take(loader(cfg, tok, prefetch=prefetch), n)
    first = loader(cfg, tok, prefetch=prefetch)
    head = take(first, 13)
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through JSON
    assert state["offset"] > 0 or state["record"] > 0
    resumed = loader(cfg, tok, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert same(head + take(resumed, n - 13), full)
    assert resumed.state_dict()["epoch"] >= 1
    first.close(), resumed.close()


def test_elastic_resume_two_ranks_to_one(corpus):
    cfg, tok = corpus
    reference = take(loader(cfg, tok, batch_size=4), 10)
    ranks = [loader(cfg, tok, rank=r, world=2) for r in range(2)]
    got = []
    for _ in range(4):
        parts = [next(ld) for ld in ranks]
        got.append(tuple(torch.cat([p[i] for p in parts]) for i in range(3)))
    one = loader(cfg, tok, batch_size=4)
    one.load_state_dict(ranks[0].state_dict())
    got += take(one, 6)
    assert same(got, reference)


def test_validation_replays_the_same_batches(corpus):
    cfg, tok = corpus
    val = loader(cfg, tok, "val")
    a = take(val, 3)
    val.reset()
    assert same(take(val, 4)[:3], a)
    train = take(loader(cfg, tok), 3)
    assert not any(torch.equal(x[0], y[0]) for x in a for y in train)


def test_changed_sources_refuse_the_saved_position(corpus, tmp_path):
    cfg, tok = corpus
    ld = loader(cfg, tok)
    next(ld)
    state = ld.state_dict()
    (tmp_path / "src" / "part3.txt").write_text("a new file changes the stream\n")
    with pytest.raises(DataError, match="source files changed"):
        loader(cfg, tok).load_state_dict(state)


@pytest.fixture
def packed_sources(tmp_path):
    """The same kind of documents as gzip and zstd JSON Lines and a parquet file."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [f"document {i} says " + "something long enough " * (1 + i % 7) for i in range(90)]
    src = tmp_path / "packed"
    src.mkdir()
    lines = lambda part: "".join(json.dumps({"text": t}) + "\n" for t in part).encode()  # noqa: E731
    (src / "a.jsonl.gz").write_bytes(gzip.compress(lines(texts[:30])))
    (src / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(texts[30:60])))
    pq.write_table(pa.table({"text": texts[60:]}), src / "c.parquet", row_group_size=7)
    cfg = DataConfig(sources=[str(src)], vocab_size=300, val_fraction=0.1, cache_dir=str(tmp_path / "cache"),
                     max_bytes=None)
    return cfg, streaming_tokenizer(cfg)


@pytest.mark.parametrize("cut", [3, 11, 19])
def test_exact_resume_in_compressed_and_parquet_sources(packed_sources, cut):
    cfg, tok = packed_sources
    full = take(loader(cfg, tok), 40)  # more than an epoch
    first = loader(cfg, tok)
    head = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(cfg, tok)
    resumed.load_state_dict(state)
    assert same(head + take(resumed, 40 - cut), full)


def test_a_source_edited_in_place_refuses_the_saved_position(corpus, tmp_path):
    """Same names and sizes, but the record at the position is another document: refused, not resumed
    at a wrong place."""
    cfg, tok = corpus
    ld = loader(cfg.model_copy(update={"shuffle": False}), tok)
    take(ld, 3)
    state = ld.state_dict()
    files = sorted((tmp_path / "src").iterdir())
    path = files[state["file"]]
    lines = path.read_text().splitlines(keepends=True)
    i = state["record"] if path.suffix == ".jsonl" else next(
        n for n, line in enumerate(lines) if line.startswith(f"line {state['record']}:"))
    lines[i] = lines[i].replace(f"{state['record']}: ", f"{state['record']}; ", 1)  # same size
    size = path.stat().st_size
    path.write_text("".join(lines))
    assert path.stat().st_size == size
    with pytest.raises(DataError, match=f"record {state['record']} of .*{path.name} is not the document the run "
                                        "was reading; the source files changed"):
        resumed = loader(cfg.model_copy(update={"shuffle": False}), tok)
        resumed.load_state_dict(state)
        next(resumed)


def test_skipped_records_are_counted_once_per_run(corpus, tmp_path):
    cfg, tok = corpus
    bad = tmp_path / "src" / "part9.jsonl"
    bad.write_text('{"text": "a good record that is long enough to keep"}\n{"text": 7}\nnot json\n{"other": 1}\n')
    cfg = cfg.model_copy(update={"on_bad_record": "skip", "shuffle": False})
    ld = loader(cfg, tok)
    take(ld, 150)  # more than one epoch: the second pass over the sources is not counted again
    assert ld.rows.position["epoch"] >= 1
    assert ld.dropped == {"wrong_type": 1, "malformed": 1, "missing_field": 1}


def test_what_the_stream_drops_is_said_on_the_next_logging_step(corpus, tmp_path):
    """A streaming run under data.on_bad_record=skip counted its skipped records but said nothing of them."""
    from kiln.data.load.streaming import StreamDrops

    class Run:  # what the callback sees of the trainer: its notices go to every sink
        def __init__(self):
            self.notices = []

        def notice(self, kind, **info):
            self.notices.append((kind, info))

    cfg, tok = corpus
    (tmp_path / "src" / "part0.jsonl").open("a").write('{"text": 7}\n{"other": 1}\n')
    ld, run = loader(cfg.model_copy(update={"on_bad_record": "skip", "shuffle": False}), tok), Run()
    drops = StreamDrops(ld)
    drops.on_step_end(run, {"loss": 1.0})
    assert run.notices == []  # nothing read yet, nothing dropped
    while ld.rows.position["file"] == 0:
        next(ld)
    drops.on_step_end(run, None)  # not a logging step
    drops.on_step_end(run, {"loss": 1.0})
    drops.on_train_end(run, {})  # no change since: said once
    (kind, info), = run.notices
    assert kind == "data_dropped" and info["dropped"] == {"wrong_type": 1, "missing_field": 1}
    assert info["examples"]["wrong_type"] == [f"{tmp_path / 'src' / 'part0.jsonl'}:51"]
    assert "dropped 2 record(s)" in info["message"] and "part0.jsonl:52" in info["message"]


def test_streaming_reports_the_files_it_passes_over_as_prepare_does(tmp_path):
    """Streaming passed over files without a word (and a sub-folder of text beside a folder of records)."""
    from kiln.config import load_config
    from kiln.data.build import build_data
    from kiln.data.prepare.pipeline import prepare
    from kiln.data.prepare.report import passed_over_text

    d = tmp_path / "corpus"
    (d / "data").mkdir(parents=True)
    (d / "prose").mkdir()
    (d / "data" / "a.jsonl").write_text("".join(json.dumps({"text": f"record number {i}"}) + "\n" for i in range(60)))
    (d / "data" / "README.md").write_text("# about these records")
    (d / "logo.png").write_bytes(b"\x89PNG")
    (d / "prose" / "p.txt").write_text("a document of prose, read from its own folder")
    common = [f"data.sources=[{d}]", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1",
              "data.val_fraction=0", "train.seq_len=16", "train.batch_size=2", "data.prefetch=0"]
    run = build_data(load_config(None, [*common, "data.streaming=true"]), torch.device("cpu"), rank=0, world=1)
    report = prepare(load_config(None, common).data).manifest["report"]
    assert report["files"] == 2 and report["files_passed_over"] == 2
    said = passed_over_text(report["files_passed_over"], report["passed_over_examples"])
    assert f"passed over: {said}" in run.summary.splitlines()
    assert [f.url for f in run.train.rows.files] == [str(d / "data" / "a.jsonl"), str(d / "prose" / "p.txt")]


def test_streaming_passes_damaged_files_under_skip(tmp_path):
    from ..read.test_sources import _damaged_files

    names = _damaged_files(tmp_path)
    cfg = DataConfig(sources=[str(tmp_path / n) for n in names], vocab_size=300, val_fraction=0, shuffle=False,
                     cache_dir=str(tmp_path / "cache"), on_bad_record="skip", dedup=False)
    ld = loader(cfg, streaming_tokenizer(cfg))
    take(ld, 3)
    while ld.rows.position["epoch"] == 0:  # read the whole first epoch: every damaged file was reached
        next(ld)
    assert ld.dropped == {"damaged_file": 3}
    with pytest.raises(DataError, match="cut.jsonl.gz: cannot read"):
        streaming_tokenizer(cfg.model_copy(update={"on_bad_record": "error"}))


def test_a_stream_without_validation_documents_trains_without_evaluating(tmp_path):
    """A prepared dataset without a 'val' split trains and says there is no validation; a stream finds out only
    when it reads its sources at the first evaluation, and then does the same instead of stopping the run."""
    from rich.console import Console

    from kiln.config import load_config
    from kiln.data.read.records import doc_hash, is_val
    from kiln.train.run import run

    from ....integration.conftest import losses

    text = next(t for t in (f"def f{i}(x):\n    return x * {i}\n" * 40 for i in range(100))
                if not is_val(doc_hash(t), 0.1))  # one document, and it falls in the train split
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(text)
    cfg = load_config(None, [f"data.sources=[{tmp_path / 'src'}]", "data.streaming=true", "data.vocab_size=300",
                             "data.val_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}", "model.size=tiny",
                             "train.device=cpu", "train.seq_len=16", "train.batch_size=2", "train.max_steps=3",
                             "train.eval_every=2", "train.early_stop.patience=1", "train.sample_tokens=0",
                             "logging.plots=false",
                             f"train.run_dir={tmp_path / 'run'}"])
    console = Console(record=True, width=400)
    run(cfg, console)
    said = console.export_text()
    assert "validation: none, no run is evaluated: the sources" in said and "hold no 'val' documents" in said
    assert "train.early_stop.patience=1 has nothing to count: this run has no validation split" in said
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert max(losses(tmp_path / "run")) == 3  # trained to the end
    assert not losses(tmp_path / "run", "eval")

    # a stream with no training documents still stops, saying so
    (tmp_path / "src" / "a.py").write_text(next(t for t in (f"y = {i}\n" * 200 for i in range(100))
                                                if is_val(doc_hash(t), 0.1)))
    with pytest.raises(DataError, match=r"hold no 'train' documents \(1 read, dropped: none; data\.val_fraction=0\.1\)"
                                        "; give more data"):
        run(cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_dir": str(tmp_path / "run2")})}),
            Console(quiet=True))


def test_a_stream_whose_every_record_was_dropped_says_so(corpus, tmp_path):
    """It said 'give more data or change data.val_fraction' when data.on_bad_record=skip had dropped them all."""
    cfg, tok = corpus
    (tmp_path / "bad.jsonl").write_text('{"text": 7}\n{"other": "x"}\n')
    cfg = cfg.model_copy(update={"sources": [str(tmp_path / "bad.jsonl")], "on_bad_record": "skip"})
    with pytest.raises(DataError, match=r"hold no 'train' documents \(0 read, dropped: 1 missing_field, 1 wrong_type; "
                                        r"data\.val_fraction=0\.1\); every record was dropped: check the files"):
        next(loader(cfg, tok))
