"""Every source format, compression and location, read in a fixed order, and resumable by position."""

from __future__ import annotations

import gzip
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data.read.sources import expand, iter_documents, stdlib_files
from kiln.errors import DataError

DOCS = ["first document\nwith two lines", "second, with a comma and \"quotes\"", "third\tone", "ünïcödé ✓"]


def texts(tmp_path, sources, **kw):
    cfg = DataConfig(sources=[str(s) for s in sources], cache_dir=str(tmp_path / "cache"), **kw)
    return [d.text for d in iter_documents(cfg)]


def test_text_units(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("para one\nline two\n\n\npara two\n  \nlast line\n")
    assert texts(tmp_path, [f]) == ["para one\nline two\n\n\npara two\n  \nlast line\n"]
    assert texts(tmp_path, [f], text_unit="line") == ["para one", "line two", "para two", "last line"]
    assert texts(tmp_path, [f], text_unit="paragraph") == ["para one\nline two", "para two", "last line"]


def test_jsonl_json_and_field(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n\n" for i, t in enumerate(DOCS)))
    (tmp_path / "b.json").write_text(json.dumps([{"body": t} for t in DOCS], indent=2))
    (tmp_path / "c.json").write_text("\n".join(json.dumps({"text": t}) for t in DOCS))  # JSON Lines named .json
    assert texts(tmp_path, [tmp_path / "a.jsonl"]) == DOCS
    assert texts(tmp_path, [tmp_path / "b.json"], field="body") == DOCS
    assert texts(tmp_path, [tmp_path / "c.json"]) == DOCS
    (tmp_path / "d.json").write_text(json.dumps(DOCS))  # an array of bare strings
    assert texts(tmp_path, [tmp_path / "d.json"]) == DOCS


def test_json_array_larger_than_a_read_chunk(tmp_path, monkeypatch):
    from kiln.data.read import readers

    monkeypatch.setattr(readers, "CHUNK", 64)  # elements and multi-byte characters straddle chunks
    docs = [f"doc {i} ✓ " + "é" * (i % 50) for i in range(200)]
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in docs]))
    assert texts(tmp_path, [tmp_path / "a.json"]) == docs


def test_parquet_csv_tsv(tmp_path):
    pq.write_table(pa.table({"id": list(range(4)), "text": DOCS}), tmp_path / "a.parquet", row_group_size=3)
    import csv

    for name, delim in (("a.csv", ","), ("a.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.writer(f, delimiter=delim)
            w.writerow(["id", "content"])
            w.writerows([i, t] for i, t in enumerate(DOCS))
    assert texts(tmp_path, [tmp_path / "a.parquet"]) == DOCS
    assert texts(tmp_path, [tmp_path / "a.csv"], field="content") == DOCS
    assert texts(tmp_path, [tmp_path / "a.tsv"], field="content") == DOCS


def test_hf_save_to_disk(tmp_path):
    import datasets  # the 'hf' extra; in the dev requirements
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "ds"))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:2]}),
                               "test": datasets.Dataset.from_dict({"text": DOCS[2:]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert texts(tmp_path, [tmp_path / "ds"]) == DOCS
    assert texts(tmp_path, [tmp_path / "dd"]) == DOCS[:2]
    assert texts(tmp_path, [tmp_path / "dd"], dataset_split="test") == DOCS[2:]
    with pytest.raises(DataError, match="without a 'validation' split"):
        texts(tmp_path, [tmp_path / "dd"], dataset_split="validation")


def test_compressed(tmp_path):
    import zstandard

    body = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(b"x\ny\n"))
    assert texts(tmp_path, [tmp_path / "a.jsonl.gz"]) == DOCS
    assert texts(tmp_path, [tmp_path / "b.jsonl.zst"]) == DOCS
    assert texts(tmp_path, [tmp_path / "c.txt.gz"], text_unit="line") == ["x", "y"]
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(body)[:-12])  # truncated
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: cannot read .*truncated or corrupt"):
        texts(tmp_path, [tmp_path / "bad.jsonl.gz"])


def test_directories_globs_order(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("b")
    (d / "a.md").write_text("a")
    (d / "sub" / "c.jsonl").write_text(json.dumps({"text": "c"}) + "\n")
    assert texts(tmp_path, [d / "*.txt", d / "**" / "*.jsonl"]) == ["b", "c"]
    (d / "image.png").write_bytes(b"\x89PNG")  # unknown suffix: not read from a directory
    (d / ".hidden.txt").write_text("hidden")
    assert texts(tmp_path, [d / "sub", d / "a.md", d / "b.txt"]) == ["c", "a", "b"]
    assert texts(tmp_path, [d]) == ["c"]  # beside records, text files are documentation (test below)
    (d / "sub" / "c.jsonl").unlink()
    assert texts(tmp_path, [d]) == ["a", "b"]
    assert texts(tmp_path, [d / "b.txt", d / "a.md"]) == ["b", "a"]  # order as given
    with pytest.raises(DataError, match="matches no readable file"):
        expand([str(d / "*.csv")])


def test_fsspec_urls(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/kiln-test/a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode())
    fs.pipe("/kiln-test/b.txt", b"from memory")
    (tmp_path / "local.txt").write_text("local")
    assert texts(tmp_path, ["memory://kiln-test/"]) == DOCS  # b.txt, text beside records, is passed over
    assert [u.rsplit("/", 1)[1] for u in expand(["memory://kiln-test/"]).passed_over] == ["b.txt"]
    assert texts(tmp_path, ["memory://kiln-test/*.txt", f"file://{tmp_path}/local.txt"]) == ["from memory", "local"]
    files = expand(["memory://kiln-test/a.jsonl"])
    assert files[0].url == "memory://kiln-test/a.jsonl" and files[0].size > 0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "text"])
def test_resume_at_position(tmp_path, fmt):
    """Starting at (file, record + 1) of any document gives exactly the rest of the stream."""
    rows = [f"doc {i}" if i % 7 else "" for i in range(50)]  # empty records are skipped but keep positions
    for k in range(2):
        part = rows[k * 25:(k + 1) * 25]
        if fmt == "jsonl":
            (tmp_path / f"{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": part}), tmp_path / f"{k}.parquet", row_group_size=4)
        else:
            (tmp_path / f"{k}.txt").write_text("".join(t + "\n\n" for t in part if t))
    cfg = DataConfig(sources=[str(tmp_path / f"*.{fmt if fmt != 'text' else 'txt'}")], on_bad_record="skip",
                     text_unit="paragraph")
    full = list(iter_documents(cfg))
    assert len(full) == 42
    for cut in (0, 5, 24, 30, 41):
        d = full[cut]
        rest = list(iter_documents(cfg, start=(d.file_index, d.record_index + 1)))
        assert [x.text for x in rest] == [x.text for x in full[cut + 1:]]
        assert [x.origin for x in rest] == [x.origin for x in full[cut + 1:]]


def test_stdlib_source():
    files = expand(["@stdlib"])
    assert len(files) > 500 and all(f.lenient and f.format == "text" for f in files)
    assert [f.path for f in files] == [str(p) for p in stdlib_files()]


def test_byte_order_mark_is_not_text(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "x"}\n')
    (tmp_path / "b.csv").write_bytes(bom + b"text,id\nhello,1\n")
    (tmp_path / "c.txt").write_bytes(bom + b"hi")
    (tmp_path / "d.json").write_bytes(bom + b'[{"text": "arr"}]')
    assert texts(tmp_path, sorted(tmp_path.glob("?.*"))) == ["x", "hello", "hi", "arr"]


def test_zstd_of_a_long_window_is_read(tmp_path):
    """A file of `zstd --long=31` (a 2 GiB window, as big corpora are compressed) was 'truncated or corrupt':
    the zstandard library decodes windows of up to 128 MiB unless told more."""
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=31, enable_ldm=True)
    writer = zstandard.ZstdCompressor(compression_params=params).compressobj()  # size unknown: the window stays
    data = writer.compress(b"".join(b'{"text": "record %d"}\n' % i for i in range(50))) + writer.flush()
    assert zstandard.get_frame_parameters(data).window_size == 1 << 31
    (tmp_path / "a.jsonl.zst").write_bytes(data)
    assert [d.text for d in iter_documents(DataConfig(sources=[str(tmp_path / "a.jsonl.zst")]))] == \
        [f"record {i}" for i in range(50)]


def test_truncated_zstd_is_an_error_not_a_shorter_file(tmp_path):
    import zstandard

    body = "".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(2000)).encode()
    z = zstandard.ZstdCompressor().compress(body)
    (tmp_path / "a.jsonl.zst").write_bytes(z[: len(z) // 2])
    (tmp_path / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"a\n") + z[:0] +
                                         zstandard.ZstdCompressor().compress(b"b\n"))  # frames one after another
    with pytest.raises(DataError, match=r"a\.jsonl\.zst: cannot read .*ends inside a frame"):
        texts(tmp_path, [tmp_path / "a.jsonl.zst"])
    kept = texts(tmp_path, [tmp_path / "a.jsonl.zst"], on_bad_record="skip")  # counted as damaged_file (below)
    assert 0 < len(kept) < 2000 and kept[0] == "doc 0 " * 20
    assert texts(tmp_path, [tmp_path / "b.txt.zst"], text_unit="line") == ["a", "b"]


def test_a_file_reached_twice_is_read_once(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("a")
    (tmp_path / "link.txt").symlink_to(tmp_path / "d" / "a.txt")
    specs = [tmp_path / "d" / "a.txt", tmp_path / "d" / "a.txt", tmp_path / "d", f"file://{tmp_path}/d/a.txt",
             tmp_path / "link.txt"]
    assert [f.url for f in expand([str(s) for s in specs])] == [str(tmp_path / "d" / "a.txt")]


def test_paths_that_lead_nowhere(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"'.*missing\.txt' does not exist\. Check"):
        expand([str(tmp_path / "missing.txt")])
    # a run resumed from another directory: its relative sources are looked for there, and the message says so
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=rf"'corpus' does not exist \(a relative path, read from the current "
                                        rf"directory {re.escape(str(tmp_path))}: run kiln from the directory"):
        expand(["corpus"])
    os.mkfifo(tmp_path / "pipe.txt")  # it exists (it was said not to): a device or a pipe is named for what it is
    for special in (tmp_path / "pipe.txt", "/dev/zero"):
        with pytest.raises(DataError, match="is not a regular file or directory"):
            expand([str(special)])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "ok.txt").write_text("ok")
    (tmp_path / "d" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(DataError, match=r"gone\.txt is a broken symbolic link \(to .*nowhere\.txt\)"):
        expand([str(tmp_path / "d")])
    (tmp_path / "d" / "gone.txt").unlink()
    os.mkfifo(tmp_path / "d" / "pipe.txt")  # in a directory: passed over (reading it waited for a writer forever)
    found = expand([str(tmp_path / "d")])
    assert [os.path.basename(f.path) for f in found] == ["ok.txt"]
    assert found.passed_over == [str(tmp_path / "d" / "pipe.txt")]


def test_unknown_files_in_a_directory_are_listed(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "data").mkdir()
    (d / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    (d / "LICENSE").write_text("license")
    (d / "README.md").write_text("# a dataset card")
    (d / "logo.png").write_bytes(b"\x89PNG")
    (d / ".DS_Store").write_bytes(b"\x00\x00")
    files = expand([str(d)])
    assert [f.url for f in files] == [str(d / "data" / "a.jsonl")]
    # hidden files pass silently; README.md is text beside records, so documentation
    assert files.passed_over == [str(d / "LICENSE"), str(d / "README.md"), str(d / "logo.png")]
    assert [f.url for f in expand([str(d)], fmt="text")][:2] == [str(d / "LICENSE"), str(d / "README.md")]


def test_urls_that_cannot_be_read_are_data_errors():
    with pytest.raises(DataError, match=r"'nosuchprotocol://x/a.jsonl': not a usable URL"):
        expand(["nosuchprotocol://x/a.jsonl"])
    with pytest.raises(DataError, match="does not exist"):
        expand(["memory://kiln-test-absent/a.jsonl"])


def test_text_is_documentation_only_in_folders_of_records(tmp_path):
    """Text beside record files (or above them: a dataset card) is passed over; a sub-folder of text without
    records is data. The whole tree's text used to be passed over as soon as any folder held records."""
    d = tmp_path / "corpus"
    for sub in ("data", "notes/deep", "data/extra"):
        (d / sub).mkdir(parents=True)
    (d / "data" / "a.jsonl").write_text('{"text": "record"}\n')
    (d / "data" / "NOTES.md").write_text("beside the records")
    (d / "README.md").write_text("# the dataset card, above the records")
    (d / "notes" / "x.txt").write_text("x")
    (d / "notes" / "deep" / "y.txt").write_text("y")
    (d / "data" / "extra" / "z.txt").write_text("z")
    files = expand([str(d)])
    assert [f.url for f in files] == [str(d / p) for p in ("data/a.jsonl", "data/extra/z.txt", "notes/deep/y.txt",
                                                           "notes/x.txt")]
    assert files.passed_over == [str(d / "README.md"), str(d / "data" / "NOTES.md")]
    everything = expand([str(d / "**" / "*")])  # a glob names its files: each is read, none passed over
    assert len(everything) == 6 and everything.passed_over == []


def _damaged_files(tmp_path):
    """A truncated .jsonl.gz and .jsonl.zst (real files cut short) of 200 records, and a fake parquet."""
    import zstandard

    lines = "".join(json.dumps({"text": f"record {i} " + "x" * 200}) + "\n" for i in range(200)).encode()
    gz, zst = gzip.compress(lines), zstandard.ZstdCompressor().compress(lines)
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[: len(gz) * 2 // 3])
    (tmp_path / "cut.jsonl.zst").write_bytes(zst[: len(zst) * 2 // 3])
    (tmp_path / "fake.parquet").write_text("this is not a parquet file\n")
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "a good document"}) + "\n")
    return ["cut.jsonl.gz", "cut.jsonl.zst", "fake.parquet", "good.jsonl"]


def test_damaged_files_are_counted_and_passed_under_skip(tmp_path):
    """A truncated .gz/.zst or a file that is not the parquet it claims stopped the run even under skip."""
    from kiln.data.read.records import RecordChecker

    names = _damaged_files(tmp_path)
    for name in names[:3]:
        with pytest.raises(DataError, match=rf"{name}: cannot read .*truncated or corrupt.*on_bad_record=skip"):
            texts(tmp_path, [tmp_path / name])
    cfg = DataConfig(sources=[str(tmp_path / n) for n in names], on_bad_record="skip")
    checker = RecordChecker.from_config(cfg)
    hashes: dict = {}
    docs = [d.text for d in iter_documents(cfg, checker=checker, hashes=hashes)]
    by_file = [sum(t.startswith("record ") for t in docs[:k]) for k in range(len(docs) + 1)]
    assert 0 < by_file[-1] < 2 * 200 and docs[-1] == "a good document"  # records before the damage kept
    assert docs[:3] == ["record 0 " + "x" * 200, "record 1 " + "x" * 200, "record 2 " + "x" * 200]
    assert checker.dropped == {"damaged_file": 3}
    assert checker.examples["damaged_file"] == [str(tmp_path / n) for n in names[:3]]
    assert sorted(hashes) == [0, 1, 2, 3]  # every file still has its hash (the dataset id needs it)


def readable_records(compressed: bytes, kind: str, paragraphs: bool) -> list[str]:
    """The complete non-blank lines (or paragraphs, blank-line separated) that decompress from the start of a cut
    `compressed` stream: each is followed by its newline (a paragraph by a blank line) before the damage."""
    import zlib

    import zstandard

    if kind == "gz":
        out = zlib.decompressobj(wbits=31).decompress(compressed)
    else:
        out = zstandard.ZstdDecompressor().decompressobj().decompress(compressed)
    end = b"\n\n" if paragraphs else b"\n"
    return [r for r in out[: out.rfind(end)].decode().split(end.decode()) if r.strip()]


@pytest.mark.parametrize("suffix,unit", [(".txt", "line"), (".txt", "paragraph"), (".jsonl", None)])
@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_a_cut_compressed_file_keeps_every_complete_record_before_the_damage(tmp_path, suffix, unit, kind):
    """A .txt.gz read by line lost up to 1 MiB of readable lines under skip (every line of a 1,390-line file)."""
    import random

    import zstandard

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 30))) for _ in range(30_000)]
    if suffix == ".jsonl":
        lines = [json.dumps({"text": t}) for t in lines]
    body = ("\n\n" if unit == "paragraph" else "\n").join(lines).encode() + b"\n"
    packed = gzip.compress(body) if kind == "gz" else zstandard.ZstdCompressor().compress(body)
    cut = packed[: len(packed) // 2]
    path = tmp_path / f"cut{suffix}.{kind}"
    path.write_bytes(cut)
    expected = readable_records(cut, kind, unit == "paragraph")
    if suffix == ".jsonl":
        expected = [json.loads(t)["text"] for t in expected]
    got = texts(tmp_path, [path], on_bad_record="skip", **({"text_unit": unit} if unit else {}))
    assert len(expected) > 10_000 and got == expected


def test_an_empty_file_of_a_directory_is_dropped_and_counted_whatever_the_policy(tmp_path):
    from kiln.data.read.records import RecordChecker

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")  # a package's empty __init__.py files, one blank
    (pkg / "sub" / "__init__.py").write_text("\n")
    (pkg / "a.py").write_text("x = 1\n")
    for spec in (pkg, pkg / "**" / "*.py"):  # a directory walked, a glob matched
        cfg = DataConfig(sources=[str(spec)])  # data.on_bad_record=error
        checker = RecordChecker.from_config(cfg)
        assert [d.text for d in iter_documents(cfg, checker=checker)] == ["x = 1\n"]
        assert dict(checker.dropped) == {"empty": 2}  # the prepare report's "dropped: empty 2"
        assert checker.examples["empty"] == [str(pkg / "__init__.py"), str(pkg / "sub" / "__init__.py")]
    empty_jsonl = pkg / "b.jsonl"  # an empty record inside a file stays a bad record
    empty_jsonl.write_text('{"text": ""}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:1: the record is empty"):
        list(iter_documents(DataConfig(sources=[str(pkg)], format="auto")))
    with pytest.raises(DataError, match=r"__init__\.py: the file is empty"):  # a file named on its own
        list(iter_documents(DataConfig(sources=[str(pkg / "__init__.py")])))


def test_an_empty_record_file_named_in_the_sources_is_said_as_an_empty_text_file_is(tmp_path):
    """An empty .jsonl, .json, .csv or .jsonl.gz named in data.sources (a download that failed) gave no records
    without a word, where an empty text file stops the run."""
    import gzip

    from kiln.data.read.records import RecordChecker

    (tmp_path / "good.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "a.jsonl").write_text("\n  \n")
    (tmp_path / "b.json").write_text("")
    (tmp_path / "c.csv").write_text("")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b""))
    for name in ("a.jsonl", "b.json", "c.csv", "d.jsonl.gz"):
        with pytest.raises(DataError, match=rf"{name}: the file is empty or only whitespace, so it holds nothing"):
            list(iter_documents(DataConfig(sources=[str(tmp_path / "good.jsonl"), str(tmp_path / name)])))
    cfg = DataConfig(sources=[str(tmp_path / "*.json*")])  # found by a glob: dropped and counted, as text files are
    checker = RecordChecker.from_config(cfg)
    assert [d.text for d in iter_documents(cfg, checker=checker)] == ["a document"]
    assert dict(checker.dropped) == {"empty": 3}


def test_a_glob_says_which_folders_and_broken_links_it_matched(tmp_path):
    """corpus/* matching corpus/2024/ left that folder's files unread without a word, a glob matching folders only
    said it matched no file, and a broken link a glob matched was passed over silently (in a folder it stops)."""
    d = tmp_path / "corpus"
    (d / "2023").mkdir(parents=True)
    (d / "2024").mkdir()
    (d / "top.jsonl").write_text('{"text": "top"}\n')
    (d / "2024" / "b.jsonl").write_text('{"text": "in 2024"}\n')
    files = expand([str(d / "*")])
    assert [f.url for f in files] == [str(d / "top.jsonl")]
    assert files.passed_over == [f"{d / '2024'}/"]  # an empty folder holds nothing left unread
    files = expand([str(d / "**")])  # its files are matched too: nothing to say
    assert [f.url for f in files] == [str(d / "2024" / "b.jsonl"), str(d / "top.jsonl")] and files.passed_over == []
    with pytest.raises(DataError, match=r"matches no readable file .* It matches folders only: name a folder itself"):
        expand([str(d / "20*")])
    (d / "gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(DataError, match=r"gone\.jsonl is a broken symbolic link"):
        expand([str(d / "*.jsonl")])


def test_a_folder_of_sources_passes_over_the_cache_and_runs_kiln_wrote_in_it(tmp_path):
    """data.sources=. with data.cache_dir and the runs inside it: a second prepare read the first one's
    manifest.json as records (a DataError: 'the record has no text field'), and under data.on_bad_record=skip
    its tokenizer and a run's metrics.jsonl as documents."""
    from kiln.data.prepare.pipeline import prepare

    (tmp_path / "corpus.txt").write_text("some text to learn from\n" * 50)
    cfg = DataConfig(sources=[str(tmp_path)], cache_dir=str(tmp_path / "cache"), vocab_size=300, workers=1)
    first = prepare(cfg)
    run = tmp_path / "runs" / "r1"  # what a run directory holds, beside its config.yaml
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "config.yaml").write_text("data: {}\n")
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 1, "loss": 5.0}\n')
    (run / "checkpoints" / "step_2" / "meta.json").write_text('{"step": 2}')
    files = expand([str(tmp_path)])
    assert [sf.url for sf in files] == [str(tmp_path / "corpus.txt")]
    assert files.passed_over == [str(tmp_path / "cache") + "/", str(run) + "/"]
    assert prepare(cfg).id == first.id  # the same data, found again
