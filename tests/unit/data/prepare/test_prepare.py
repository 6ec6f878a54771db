"""prepare: shards and manifest, content addressing, verification, resume after kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.config import DataConfig
from kiln.data.format.dataset import open_dataset
from kiln.data.prepare import keys
from kiln.data.prepare import pipeline as prepare_mod
from kiln.data.prepare.pipeline import prepare
from kiln.data.prepare.tokenizer import train_bpe
from kiln.data.read.records import doc_hash, is_val
from kiln.data.read.sources import stdlib_files
from kiln.errors import DataError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSON Lines files of stdlib source (~600 KB) with one duplicate, and a small BPE."""
    d = tmp_path_factory.mktemp("corpus")
    texts = [p.read_text() for p in stdlib_files()[100:220]]
    texts = [t for t in texts if t.strip()]
    half = len(texts) // 2
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:half]))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[half:] + texts[:1]))
    train_bpe(texts, 512).save(d / "tokenizer.json")
    return d, texts


def config(corpus, tmp_path, **kw) -> DataConfig:
    d, _ = corpus
    base = dict(sources=[str(d / "*.jsonl")], tokenizer=str(d / "tokenizer.json"), cache_dir=str(tmp_path / "cache"),
                val_fraction=0.2, shard_tokens=20_000, max_bytes=None, workers=1)
    return DataConfig(**{**base, **kw})


def read_docs(ds, split: str) -> list[list[int]]:
    docs = []
    for bin_path, idx_path, n in ds.shards(split):
        tokens = np.fromfile(bin_path, ds.dtype)
        ends = np.fromfile(idx_path, "<u8").astype(np.int64)
        assert tokens.size == n and ends[-1] == n
        docs.extend(np.split(tokens, ends[:-1]))
    return [d.tolist() for d in docs]


def expected(texts: list[str], fraction: float) -> dict[str, list[str]]:
    out, seen = {"train": [], "val": []}, set()
    for t in texts + texts[:1]:
        if doc_hash(t) not in seen:
            seen.add(doc_hash(t))
            out["val" if is_val(doc_hash(t), fraction) else "train"].append(t)
    return out


def test_prepare_writes_shards_manifest_and_report(corpus, tmp_path):
    d, texts = corpus
    ds = prepare(config(corpus, tmp_path))
    m = ds.manifest
    assert m["format"] == "kiln-shards/1" and m["dtype"] == "uint16" and m["id"] == ds.path.name
    assert m["tokenizer_hash"] == ds.tokenizer.hash and m["eos_id"] == ds.tokenizer.eos_id
    assert [s["path"] for s in m["sources"]] == [str(d / "a.jsonl"), str(d / "b.jsonl")]
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in m["sources"])
    assert len(m["splits"]["train"]["shards"]) > 3  # shard_tokens is small
    assert {"documents", "tokens", "dropped", "document_tokens"} <= m["report"].keys()
    assert json.loads((ds.path / "report.json").read_text()) == m["report"]
    assert m["report"]["duplicates_removed"] == 1
    want = expected(texts, 0.2)
    assert want["val"] and want["train"]
    for split in ("train", "val"):
        docs = read_docs(ds, split)
        assert all(doc[-1] == ds.tokenizer.eos_id for doc in docs)
        assert [ds.tokenizer.decode(doc[:-1]) for doc in docs] == want[split]  # order kept within a split
        assert m["splits"][split]["documents"] == len(docs)
    assert ds.verify() == []


def test_parallel_workers_write_the_same_shards(corpus, tmp_path, monkeypatch):
    serial = prepare(config(corpus, tmp_path / "1", bos_token="auto", tokenizer=None, vocab_size=400))
    monkeypatch.setattr(prepare_mod, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(prepare_mod, "BATCH_BYTES", 50_000)
    pooled = prepare(config(corpus, tmp_path / "2", bos_token="auto", tokenizer=None, vocab_size=400, workers=2))
    assert pooled.path.name == serial.path.name
    assert pooled.manifest["splits"] == serial.manifest["splits"]
    assert all(doc[0] == serial.tokenizer.bos_id for doc in read_docs(serial, "train"))


def test_content_addressing(corpus, tmp_path):
    d, texts = corpus
    cfg = config(corpus, tmp_path)
    first = prepare(cfg)
    stamp = (first.path / "manifest.json").stat().st_mtime_ns
    again = prepare(cfg.model_copy(update={"workers": 2}))  # no effect on the output
    assert again.path == first.path and (first.path / "manifest.json").stat().st_mtime_ns == stamp
    # one byte changed in place (same size, same second): the remembered file hash must not be reused
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (copy / name).write_bytes((d / name).read_bytes())
    same_input = prepare(cfg.model_copy(update={"sources": [str(copy / "*.jsonl")]}))
    assert same_input.path == first.path  # content addressed: where the files live does not matter
    at = (copy / "a.jsonl").read_bytes().index(b"def ")
    with open(copy / "a.jsonl", "r+b") as f:
        f.seek(at + 2)
        f.write(b"g")  # "def " -> "deg "
    other_input = prepare(cfg.model_copy(update={"sources": [str(copy / "*.jsonl")]}))
    # another tokenizer, another setting
    train_bpe(texts[:20], 400).save(tmp_path / "tok2.json")
    other_tok = prepare(cfg.model_copy(update={"tokenizer": str(tmp_path / "tok2.json")}))
    other_setting = prepare(cfg.model_copy(update={"val_fraction": 0.1}))
    ids = {first.id, other_input.id, other_tok.id, other_setting.id}
    assert len(ids) == 4
    assert other_tok.manifest["tokenizer_hash"] != first.manifest["tokenizer_hash"]


def test_verify_detects_a_flipped_byte(corpus, tmp_path):
    ds = prepare(config(corpus, tmp_path))
    shard = ds.path / "train" / "00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[1001] ^= 0x01
    shard.write_bytes(bytes(raw))
    problems = ds.verify()
    assert len(problems) == 1 and "train/00001: sha256 differs" in problems[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "prepare", "--verify", str(ds.path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "train/00001: sha256 differs" in r.stderr


def test_open_dataset_refuses_other_tokenizer_and_incomplete(corpus, tmp_path):
    ds = prepare(config(corpus, tmp_path))
    assert open_dataset(ds.path, ds.tokenizer.hash).id == ds.id
    with pytest.raises(DataError, match=f"tokenized with tokenizer {ds.tokenizer.hash}, but this run uses "
                                        "tokenizer 0123456789abcdef"):
        open_dataset(ds.path, "0123456789abcdef")
    (ds.path / "manifest.json").unlink()
    with pytest.raises(DataError, match="incomplete .*Run the same `kiln prepare` again"):
        open_dataset(ds.path)
    with pytest.raises(DataError, match="is not a prepared dataset .*give the directory `kiln prepare` printed"):
        open_dataset(ds.path / "train")
    with pytest.raises(DataError, match="is a file, not a prepared dataset"):
        open_dataset(ds.path / "report.json")


def test_no_documents_is_a_clear_error(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n{"text": " "}\n')
    cfg = DataConfig(sources=[str(tmp_path / "a.jsonl")], on_bad_record="skip", cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"no training documents .*dropped: 2 empty; to validation: 0\); check"):
        prepare(cfg)
    one = next(t for t in ("a", "b", "c", "d", "e", "f") if is_val(doc_hash(t * 20), 0.5))  # lands in val
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": one * 20}) + "\n")
    with pytest.raises(DataError, match=r"to validation: 1\); give more documents or lower data.val_fraction=0.5"):
        prepare(cfg.model_copy(update={"val_fraction": 0.5}))


KILLABLE = """
import json, sys
from kiln.config import DataConfig
from kiln.data.prepare import keys
from kiln.data.prepare import pipeline as prepare_mod
if __name__ == "__main__":
    prepare_mod.POOL_MIN_BYTES = 0  # a pool even for this small corpus when workers > 1
    prepare_mod.BATCH_BYTES = 5_000
    prepare_mod.prepare(DataConfig(**json.loads(sys.argv[1])))
"""

STALL = """
import signal
from kiln.data.prepare import writer
finish = writer.ShardWriter.finish
def stall(self):
    finish(self)
    if self.split == "train" and self.index == {shards}:
        print("stalled", flush=True)
        signal.pause()  # until killed
writer.ShardWriter.finish = stall
"""


def stalling(script: str, shards: int) -> str:
    """`script` that prints "stalled" and stops for good once `shards` train shards are complete."""
    return script.replace("if __name__", STALL.format(shards=shards) + "if __name__", 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_kill_9_then_rerun_finishes_without_redoing_shards(corpus, tmp_path, workers):
    _, texts = corpus
    cfg = config(corpus, tmp_path, shard_tokens=2_000, val_fraction=0.05, workers=workers)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", stalling(KILLABLE, 5), cfg.model_dump_json()], env=env,
                            stdout=subprocess.PIPE, text=True)
    cache = tmp_path / "cache" / "datasets"
    stalled = proc.stdout.readline().strip() == "stalled"  # train shards 0 to 4 are complete
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert stalled and proc.returncode == -signal.SIGKILL, "prepare ended before it could be killed"
    (partial,) = [p.parent for p in cache.glob("partial-*/train")]
    assert not (partial / "manifest.json").exists()
    assert [p.name for p in cache.iterdir() if not p.name.startswith("partial-")] == []  # no dataset id yet
    with pytest.raises(DataError, match="incomplete"):
        open_dataset(partial)
    kept = {p.name: p.stat().st_mtime_ns for p in (partial / "train").glob("0000[0-4].bin")}
    assert len(kept) == 5

    ds = prepare(cfg)  # the rerun (it would wait forever on the lock if a worker outlived the killed parent)
    assert ds.path.parent == cache and not partial.exists()  # renamed to the id once complete
    assert ds.manifest["report"]["resumed_shards"] >= 5
    assert {p: (ds.path / "train" / p).stat().st_mtime_ns for p in kept} == kept  # not written again
    assert not list(ds.path.rglob("*.tmp"))
    assert ds.verify() == []
    want = expected(texts, 0.05)
    for split in ("train", "val"):
        assert [ds.tokenizer.decode(doc[:-1]) for doc in read_docs(ds, split)] == want[split]


def test_same_data_prepared_by_two_processes_at_once(corpus, tmp_path):
    cfg = config(corpus, tmp_path, shard_tokens=2_000, workers=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = KILLABLE.replace("prepare_mod.prepare(", "print(prepare_mod.prepare(")
    script = script.replace("argv[1])))", "argv[1]))).path)")
    procs = [subprocess.Popen([sys.executable, "-c", script, cfg.model_dump_json()], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # the second waited on the lock, then found the first's dataset
    datasets = tmp_path / "cache" / "datasets"
    ds = open_dataset(outs[0][0].strip())
    assert ds.verify() == [] and not list(datasets.glob("partial-*/"))
    assert [p.name for p in datasets.iterdir() if p.is_dir()] == [ds.id]


def test_source_hashes_are_taken_while_reading(tmp_path):
    """Each source's sha256 in the manifest is the file's, whatever its format and compression, also for
    files that max_bytes left unread."""
    import csv
    import gzip
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [p.read_text() for p in stdlib_files()[300:340]]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[:10]).encode()
    (tmp_path / "a.txt").write_text(texts[10])
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": texts[11:20]}), tmp_path / "d.parquet")
    with open(tmp_path / "e.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text"], *([t] for t in texts[20:30])])
    sources = [str(tmp_path / n) for n in ("a.txt", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.csv")]
    train_bpe(texts, 300).save(tmp_path / "tok.json")
    for max_bytes in (None, 1000):  # 1000: only a.txt is read, the others are hashed at the end
        cfg = DataConfig(sources=sources, tokenizer=str(tmp_path / "tok.json"), max_bytes=max_bytes,
                         on_bad_record="skip", cache_dir=str(tmp_path / f"cache{max_bytes}"))
        ds = prepare(cfg)
        assert [s["sha256"] for s in ds.manifest["sources"]] == [
            hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in sources]
        assert [s["bytes"] for s in ds.manifest["sources"]] == [os.path.getsize(f) for f in sources]


def test_a_dataset_is_named_by_its_id_only_once_complete(corpus, tmp_path, monkeypatch):
    from kiln.data.prepare import writer

    real_finish, calls = writer.ShardWriter.finish, []

    def finish_then_fail(self):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("injected")
        real_finish(self)

    monkeypatch.setattr(writer.ShardWriter, "finish", finish_then_fail)
    cfg = config(corpus, tmp_path)
    with pytest.raises(RuntimeError, match="injected"):
        prepare(cfg)
    datasets = tmp_path / "cache" / "datasets"
    (partial,) = [p for p in datasets.iterdir() if p.is_dir()]
    assert partial.name.startswith("partial-") and not (partial / "manifest.json").exists()
    monkeypatch.setattr(writer.ShardWriter, "finish", real_finish)
    ds = prepare(cfg)
    assert ds.manifest["report"]["resumed_shards"] == 2 and ds.verify() == []
    assert [p.name for p in datasets.iterdir() if p.is_dir()] == [ds.id]


def test_unchanged_or_copied_sources_reuse_the_dataset_without_encoding(corpus, tmp_path, monkeypatch):
    d, _ = corpus
    cfg = config(corpus, tmp_path)
    first = prepare(cfg)

    def fail(*args, **kwargs):
        raise AssertionError("encoded again")

    monkeypatch.setattr(prepare_mod, "Encoder", fail)
    monkeypatch.setattr(prepare_mod, "file_sha256", fail)
    again = prepare(cfg)  # the remembered file hashes give the id: nothing is read
    assert again.path == first.path
    copy = tmp_path / "copy"  # new paths, inodes and times: hashed again, not encoded again
    copy.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (copy / name).write_bytes((d / name).read_bytes())
    monkeypatch.undo()
    monkeypatch.setattr(prepare_mod, "Encoder", fail)
    assert prepare(cfg.model_copy(update={"sources": [str(copy / "*.jsonl")]})).path == first.path


def test_sources_without_a_key_are_hashed_first_and_reused(corpus, tmp_path, monkeypatch):
    """What a remote file without ETag or checksum gets: no remembered hash, so it is read to be recognised."""
    monkeypatch.setattr(prepare_mod, "_memo_key", lambda sf: None)
    cfg = config(corpus, tmp_path)
    first = prepare(cfg)
    assert not (tmp_path / "cache" / "source-hashes.json").exists()

    def fail(*args, **kwargs):
        raise AssertionError("encoded again")

    monkeypatch.setattr(prepare_mod, "Encoder", fail)
    assert prepare(cfg).path == first.path


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_script_without_main_guard_works_with_forked_workers(corpus, tmp_path):
    cfg = config(corpus, tmp_path, workers=2)
    script = tmp_path / "script.py"
    script.write_text("import json, sys\nfrom kiln.config import DataConfig\n"
                      "from kiln.data.prepare import pipeline as p\n"
                      "p.POOL_MIN_BYTES = 0\n"
                      "print(p.prepare(DataConfig(**json.loads(sys.argv[1]))).path)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, str(script), cfg.model_dump_json()], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert open_dataset(r.stdout.strip()).verify() == []


def test_cli_prepare_reports_bad_records(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "first document"}\n{"txt": "wrong field"}\n{"text": "third"}\n')
    (tmp_path / "cfg.yaml").write_text(f"data:\n  sources: [{tmp_path / 'a.jsonl'}]\n  vocab_size: 300\n"
                                       f"  val_fraction: 0\n  cache_dir: {tmp_path / 'cache'}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "kiln.cli", "prepare", str(tmp_path / "cfg.yaml")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'a.jsonl'}:2: the record has no text field" in " ".join(r.stderr.split())
    r = subprocess.run(cmd + ["data.on_bad_record=skip"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    ds = open_dataset(out[-1])
    assert ds.manifest["report"]["dropped"] == {"missing_field": 1}
    assert ds.manifest["splits"]["train"]["documents"] == 2
    assert any("dropped: missing_field" in line for line in out)


def test_full_disk_is_a_resource_error_and_keeps_finished_shards(corpus, tmp_path, monkeypatch):
    import errno

    from kiln.data.prepare import writer
    from kiln.errors import ResourceError

    real_finish, calls = writer.ShardWriter.finish, []

    def finish_then_full(self):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_finish(self)

    monkeypatch.setattr(writer.ShardWriter, "finish", finish_then_full)
    cfg = config(corpus, tmp_path)
    with pytest.raises(ResourceError, match="no space left .*finished shards are kept"):
        prepare(cfg)
    monkeypatch.setattr(writer.ShardWriter, "finish", real_finish)
    ds = prepare(cfg)
    assert ds.manifest["report"]["resumed_shards"] == 2 and ds.verify() == []


def test_special_token_text_in_a_document_is_plain_text(corpus, tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "before <|endoftext|> after"}) + "\n")
    cfg = config(corpus, tmp_path, sources=[str(tmp_path / "a.jsonl")], val_fraction=0.0)
    ds = prepare(cfg)
    (doc,) = read_docs(ds, "train")
    eos = ds.tokenizer.eos_id
    assert doc.count(eos) == 1 and doc[-1] == eos
    assert ds.tokenizer.decode(doc[:-1]) == "before <|endoftext|> after"
    parsed = prepare(cfg.model_copy(update={"parse_special_tokens": True}))
    assert parsed.id != ds.id and read_docs(parsed, "train")[0].count(eos) == 2


def test_vocabulary_above_uint16_gives_uint32_shards(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<|endoftext|>"])
    tk.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w65535 w65536 w69999 nope")
    ds = prepare(DataConfig(sources=[str(tmp_path / "a.txt")], tokenizer=str(tmp_path / "big.json"),
                            val_fraction=0.0, cache_dir=str(tmp_path / "cache")))
    assert ds.dtype == np.uint32
    assert read_docs(ds, "train") == [[3, 65537, 65538, 70001, 1, 0]]


def test_a_killed_worker_is_a_resource_error(corpus, tmp_path, monkeypatch):
    """What the OOM killer does to a tokenizer worker: a clear error, and the next run completes."""
    import multiprocessing

    from kiln.data.prepare.encode import Encoder
    from kiln.errors import ResourceError

    monkeypatch.setattr(prepare_mod, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(prepare_mod, "BATCH_BYTES", 2_000)
    cfg = config(corpus, tmp_path, workers=2)
    submit, killed = Encoder.submit, []

    def kill_a_worker_then_submit(self, tag, texts):
        if not killed:  # the workers are started; the first batch is on its way
            killed.append(multiprocessing.active_children()[0].pid)
            os.kill(killed[0], signal.SIGKILL)
        submit(self, tag, texts)

    monkeypatch.setattr(Encoder, "submit", kill_a_worker_then_submit)
    with pytest.raises(ResourceError, match="tokenizer worker process died"):
        prepare(cfg)
    assert killed
    monkeypatch.setattr(Encoder, "submit", submit)
    assert prepare(cfg).verify() == []


HALF_SENT = """
import concurrent.futures.process as cfp, json, os, struct, sys, time
from kiln.config import DataConfig
from kiln.data.prepare import keys
from kiln.data.prepare import pipeline as prepare_mod
real = cfp._sendback_result
def half_sent(result_queue, work_id, result=None, **kw):
    if result is None:  # a worker's start-up task
        return real(result_queue, work_id, result, **kw)
    with result_queue._wlock:  # a result's header and part of its body, then nothing more
        os.write(result_queue._writer.fileno(), struct.pack("!i", 1 << 20) + bytes(1000))
        os.write(1, b"half-sent\\n")
        time.sleep(120)
cfp._sendback_result = half_sent  # in the forked workers
if __name__ == "__main__":
    prepare_mod.POOL_MIN_BYTES = 0
    prepare_mod.prepare(DataConfig(**json.loads(sys.argv[1])))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_while_a_worker_sends_a_result_exits(corpus, tmp_path, sig):
    """Ctrl-C (or SIGTERM) stops the workers; one stopped halfway through sending a result used to leave the
    pool's thread reading the rest forever, so the interrupted prepare never exited. Forked workers must not
    keep prepare's SIGTERM handler: stopped, they raised in the middle of the pool's code and never exited."""
    cfg = config(corpus, tmp_path, workers=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HALF_SENT, cfg.model_dump_json()], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline() != "half-sent\n":  # a worker stopped halfway through sending a result
        proc.kill()
        pytest.fail(f"no worker sent a result: {proc.communicate()[1]}")
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert ("KeyboardInterrupt" if sig == signal.SIGINT else "Interrupted: SIGTERM") in err and proc.returncode != 0


def _truncate(ds):
    with open(ds.path / "train" / "00001.bin", "r+b") as f:
        f.truncate(100)


def _edit_manifest(ds):
    m = json.loads((ds.path / "manifest.json").read_text())
    del m["splits"]["train"]["shards"][1]  # the split's totals still count it
    (ds.path / "manifest.json").write_text(json.dumps(m))


DAMAGE = {
    "truncated shard": _truncate,
    "deleted index": lambda ds: (ds.path / "train" / "00001.idx").unlink(),
    "deleted shard": lambda ds: (ds.path / "train" / "00002.bin").unlink(),
    "deleted tokenizer": lambda ds: (ds.path / "tokenizer.json").unlink(),
    "manifest not JSON": lambda ds: (ds.path / "manifest.json").write_text('{"format": "kiln-shards/1", '),
    "manifest without splits": lambda ds: (ds.path / "manifest.json").write_text(json.dumps(
        {k: v for k, v in ds.manifest.items() if k != "splits"})),
    "manifest edited": _edit_manifest,
}


@pytest.fixture(scope="module")
def prepared_cache(corpus, tmp_path_factory) -> Path:
    """A cache directory holding the corpus prepared with `config`'s settings, to copy, not to change."""
    root = tmp_path_factory.mktemp("prepared")
    prepare(config(corpus, root))
    return root / "cache"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_dataset_is_prepared_again_not_reused(corpus, prepared_cache, tmp_path, damage):
    """A finished dataset is checked cheaply (manifest, file sizes) before reuse; a damaged one is removed
    and made again, and the loader refuses it with a message saying so."""
    from kiln.data.load.loader import PackedLoader

    shutil.copytree(prepared_cache, tmp_path / "cache")  # prepared once for every kind of damage
    cfg = config(corpus, tmp_path)
    first = prepare(cfg)  # the finished dataset, reused
    DAMAGE[damage](first)
    with pytest.raises(DataError, match="damaged|cannot read"):
        PackedLoader.from_datasets(open_dataset(first.path, first.tokenizer.hash), "train", 64, 2)
    again = prepare(cfg)
    assert again.path == first.path and again.manifest["report"]["resumed_shards"] == 0
    assert again.verify() == [] and again.manifest["splits"] == first.manifest["splits"]
    assert sorted(p.name for p in again.path.parent.iterdir() if p.is_dir()) == [first.id]


def test_verify_names_shard_files_the_manifest_does_not(corpus, tmp_path):
    ds = prepare(config(corpus, tmp_path))
    n = len(ds.manifest["splits"]["train"]["shards"])
    (ds.path / "train" / f"{n:05d}.bin").write_bytes(b"\1\0")
    assert ds.verify() == [f"train/{n:05d}.bin: a shard file the manifest does not name"]


def test_a_vocabulary_with_ids_above_its_size_gives_wide_enough_shards(tmp_path):
    """Token ids may skip numbers: the shard dtype and the vocabulary size follow the largest id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tk = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "<|endoftext|>": 70_000}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(tmp_path / "holes.json"))
    (tmp_path / "a.txt").write_text("a a b")
    ds = prepare(DataConfig(sources=[str(tmp_path / "a.txt")], tokenizer=str(tmp_path / "holes.json"),
                            val_fraction=0.0, cache_dir=str(tmp_path / "cache")))
    assert ds.dtype == np.uint32 and ds.manifest["vocab_size"] == 70_001 and ds.tokenizer.vocab_size == 70_001
    assert read_docs(ds, "train") == [[1, 1, 0, 70_000]]


def test_a_prepare_killed_while_another_waits_on_its_lock(corpus, tmp_path):
    """The waiter gets the lock when the holder dies (kill -9), goes on from its finished shards, and
    leaves no lock file or staging directory behind."""
    cfg = config(corpus, tmp_path, shard_tokens=2_000, val_fraction=0.05)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = KILLABLE.replace("prepare_mod.prepare(", "print(prepare_mod.prepare(")
    script = script.replace("argv[1])))", "argv[1]))).path)")
    script = script.replace("argv[1]))", "argv[1])), console=Console(stderr=True, width=400), progress=False")
    script = script.replace("if __name__", "from rich.console import Console\nif __name__", 1)  # says it waits
    holder = subprocess.Popen([sys.executable, "-c", stalling(KILLABLE, 3), cfg.model_dump_json()], env=env,
                              stdout=subprocess.PIPE, text=True)
    cache = tmp_path / "cache"
    assert holder.stdout.readline() == "stalled\n"  # train shards 0 to 2 are complete
    waiter = subprocess.Popen([sys.executable, "-c", script, cfg.model_dump_json()], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    seen = []
    while not (seen and "waiting for another process preparing the same dataset" in seen[-1]):
        seen.append(waiter.stderr.readline())
        assert seen[-1], f"the waiter did not wait on the lock: {seen}"
    assert waiter.poll() is None  # waiting on the lock
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out, err = waiter.communicate(timeout=120)
    assert holder.returncode == -signal.SIGKILL and waiter.returncode == 0, err
    ds = open_dataset(out.strip())
    assert ds.manifest["report"]["resumed_shards"] >= 3 and ds.verify() == []
    assert not list(cache.rglob("*.lock")) and not list(cache.glob("datasets/partial-*"))


def test_new_readers_make_a_new_dataset(corpus, tmp_path, monkeypatch):
    """Readers that give other documents for the same bytes (READERS_VERSION) never reuse the old dataset."""
    first = prepare(config(corpus, tmp_path))
    monkeypatch.setattr(keys, "READERS_VERSION", keys.READERS_VERSION + 1)
    second = prepare(config(corpus, tmp_path))
    assert second.path != first.path and second.manifest["settings"]["readers"] == keys.READERS_VERSION


def test_init_from_data_starts_each_document_as_its_tokenizer_does(corpus, tmp_path):
    """A model whose tokenizer's post-processor puts <s> first gets <s> before every document of its CPT data (it
    used to get none), and the report says so; data.bos_token=null still leaves it out."""
    from tokenizers import processors

    from kiln.config import load_config

    d, texts = corpus
    model = tmp_path / "model"
    model.mkdir()
    tk = train_bpe(texts[:20], 400, ["<unk>", "<s>", "</s>"]).tk
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(model / "tokenizer.json"))
    base = [f"model.init_from={model}", f"data.sources=[{d / 'a.jsonl'}]", f"data.cache_dir={tmp_path / 'c'}",
            "data.workers=1", "data.val_fraction=0"]
    for extra, bos in (((), 1), (("data.bos_token=null",), None)):
        ds = prepare(load_config(None, [*base, *extra]).data)
        tokens = np.concatenate([np.fromfile(b, dtype=ds.dtype) for b, _, _ in ds.shards("train")])
        docs = ds.split("train")["documents"]
        assert (int((tokens == 1).sum()), int((tokens == 2).sum())) == ((docs if bos else 0), docs)
        assert ds.manifest["bos_id"] == bos
        said = ds.manifest["report"]["special_tokens"]
        assert said == ("<s> before (as the tokenizer's own post-processor puts it first), </s> after" if bos else
                        "no BOS before (data.bos_token=null), </s> after")


def test_a_prepare_that_fails_on_bad_data_leaves_no_partial_folder(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(50)) + '{"text": 7}\n')
    train_bpe([f"document number {i}" for i in range(50)], 300).save(tmp_path / "tok.json")
    cfg = DataConfig(sources=[str(src)], tokenizer=str(tmp_path / "tok.json"), cache_dir=str(tmp_path / "cache"),
                     val_fraction=0)
    with pytest.raises(DataError, match=r"a.jsonl:51: the record has a text field that is not a string"):
        prepare(cfg)
    assert not list((tmp_path / "cache" / "datasets").glob("partial-*"))
