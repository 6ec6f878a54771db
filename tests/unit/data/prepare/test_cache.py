"""The cache directory: opened writable, clear write errors, and what interrupted prepares leave goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kiln.config import DataConfig
from kiln.data.prepare import pipeline as prepare_mod
from kiln.data.prepare.cache import (
    PARTIAL_KEEP_DAYS,
    cache_errors,
    open_cache,
    remove_stale,
    write_inputs,
)
from kiln.data.prepare.pipeline import _local_key, _local_key_now, prepare
from kiln.data.prepare.tokenizer import train_bpe

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fcntl: a live prepare cannot be told apart")

HOLD = """
import sys, time
from pathlib import Path
from kiln.files import file_lock
with file_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def staging(datasets, name: str, source, age_days: float = 0.0):
    d = datasets / name
    (d / "train").mkdir(parents=True)
    (d / "train" / "00000.bin").write_bytes(b"\0\0")
    write_inputs(d, [_local_key(str(source))])
    if age_days:
        t = time.time() - age_days * 86400
        for p in (d / "train", d):
            os.utime(p, (t, t))
    return d


def test_abandoned_staging_directories_go_when_they_can_never_be_resumed_or_are_old(tmp_path):
    datasets = tmp_path / "datasets"
    src, changed = tmp_path / "a.txt", tmp_path / "b.txt"
    src.write_text("one")
    changed.write_text("two")
    resumable = staging(datasets, "partial-aaaa", src)
    staging(datasets, "partial-bbbb", changed)
    staging(datasets, "partial-cccc", src, age_days=PARTIAL_KEEP_DAYS + 1)
    live = staging(datasets, "partial-dddd", changed, age_days=PARTIAL_KEEP_DAYS + 1)
    mine = staging(datasets, "partial-eeee", changed)
    changed.write_text("two, edited")  # the key of partial-bbbb named the old file
    (datasets / "finished").mkdir()
    (datasets / "finished" / "manifest.json").write_text("{}")
    (datasets / "sizes-1111").write_text("finished")
    (datasets / "sizes-2222").write_text("gone")
    (datasets / "partial-ffff.lock").touch()  # left by an earlier version, held by no one
    (datasets / "damaged-x-1").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(datasets / "partial-dddd.lock")], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = remove_stale(datasets, keep=mine.name, key_of=_local_key_now)
        assert live.is_dir()  # old and its source changed, but a live process fills it
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert sorted(p.name for p in removed) == ["damaged-x-1", "partial-bbbb", "partial-cccc", "sizes-2222"]
    assert resumable.is_dir() and mine.is_dir() and (datasets / "sizes-1111").is_file()
    assert sorted(p.name for p in datasets.iterdir()) == [
        "finished", "partial-aaaa", "partial-dddd", "partial-dddd.lock", "partial-eeee", "sizes-1111"]
    removed = remove_stale(datasets, keep=mine.name, key_of=_local_key_now)  # its holder is dead now
    assert [p.name for p in removed] == ["partial-dddd"]


def test_a_prepare_run_after_the_data_was_edited_removes_the_interrupted_ones_shards(tmp_path, monkeypatch):
    from kiln.data.prepare import writer

    texts = [f"document {i}: " + "word " * (i % 50) for i in range(400)]
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_bpe(texts, 300).save(tmp_path / "tok.json")
    cfg = DataConfig(sources=[str(src)], tokenizer=str(tmp_path / "tok.json"), cache_dir=str(tmp_path / "cache"),
                     shard_tokens=500, val_fraction=0.1)
    real_finish, calls = writer.ShardWriter.finish, []

    def finish_then_fail(self):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        real_finish(self)

    monkeypatch.setattr(writer.ShardWriter, "finish", finish_then_fail)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    monkeypatch.setattr(writer.ShardWriter, "finish", real_finish)
    datasets = tmp_path / "cache" / "datasets"
    (interrupted,) = datasets.glob("partial-*/")
    assert list(interrupted.glob("train/*.json"))
    src.write_text(src.read_text() + json.dumps({"text": "one more document"}) + "\n")  # the user fixes the data
    ds = prepare(cfg)
    assert not interrupted.exists()
    assert sorted(p.name for p in datasets.iterdir()) == sorted([ds.id, *(p.name for p in datasets.glob("sizes-*"))])
    assert not list((tmp_path / "cache").rglob("*.lock")) and not (ds.path / "inputs.json").exists()
    assert prepare_mod.prepare(cfg).path == ds.path


def test_a_cache_dir_that_cannot_be_a_directory_is_a_config_error(tmp_path):
    from kiln.errors import ConfigError

    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "file").write_text("x")
    for where in ("file", "file/sub"):
        cfg = DataConfig(sources=[str(tmp_path / "a.txt")], cache_dir=str(tmp_path / where), vocab_size=300)
        with pytest.raises(ConfigError, match=f"data.cache_dir={tmp_path / where}: cannot write there .*set "
                                              "data.cache_dir to a writable directory"):
            prepare(cfg)
    assert open_cache(str(tmp_path / "new" / "cache")).is_dir()  # a missing one is made


def test_write_errors_under_the_cache_say_what_to_do(tmp_path):
    import errno

    from kiln.errors import ConfigError, ResourceError

    root = tmp_path / "cache"
    with pytest.raises(ResourceError, match="no space left writing .*free some or set data.cache_dir"):
        with cache_errors(root):
            raise OSError(errno.ENOSPC, "No space left on device")  # a write() names no file
    with pytest.raises(ConfigError, match=f"cannot write {root / 'datasets' / 'x'} in data.cache_dir"):
        with cache_errors(root):
            raise OSError(errno.EROFS, "Read-only file system", str(root / "datasets" / "x"))
    with pytest.raises(FileNotFoundError):  # not the cache's: passed on as it is
        with cache_errors(root):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "elsewhere"))


def test_temporary_files_of_killed_writers_go_after_a_day(tmp_path):
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    old_memo, new_memo = tmp_path / "source-hashes.json.123.tmp", tmp_path / "source-hashes.json.456.tmp"
    (tmp_path / "tokenizers" / "bpe-300-ab").mkdir(parents=True)
    old_tok = tmp_path / "tokenizers" / "bpe-300-ab" / "tokenizer.tmp140"
    for f in (old_memo, new_memo, old_tok):
        f.write_text("{")
    day_ago = time.time() - 86400 - 60
    for f in (old_memo, old_tok):
        os.utime(f, (day_ago, day_ago))
    removed = remove_stale(datasets, keep="partial-none", key_of=_local_key_now)
    assert sorted(removed) == sorted([old_memo, old_tok]) and new_memo.is_file()  # a live writer's is kept
