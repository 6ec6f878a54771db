"""Training a BPE: long unbroken words are cut (quick, lossless), and Ctrl-C or SIGTERM stop it at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.data.format.dataset import open_dataset
from kiln.data.prepare.bpe import WORD_BYTES
from kiln.data.prepare.tokenizer import Tokenizer, train_bpe

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def prepare_cli(cache: Path, *overrides: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln.cli", "prepare", f"data.cache_dir={cache}", "data.workers=1",
                             *overrides], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_long_words_are_cut_for_the_trainer_and_encode_losslessly():
    tok = train_bpe(["x" * 5000, "hello world " * 50, "ab" * 3000], 300)
    words = tok.tk.pre_tokenizer.pre_tokenize_str("hello " + "x" * 1000)
    assert [len(w) for w, _ in words] == [5, WORD_BYTES, WORD_BYTES, WORD_BYTES, 1 + 1000 - 3 * WORD_BYTES]  # "Ġxxx.."
    for text in ["x" * 100_000 + " ünïcode ✓" * 100, "é" * 1000, " " * 3000, "hello world"]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_prepare_trains_a_tokenizer_on_3_mb_words_in_seconds(tmp_path):
    """A few valid records of one repeated character (3 MB each, well under data.max_record_bytes) kept the BPE
    trainer busy for hours; now they train quickly and every document round-trips through the shards."""
    rng = np.random.default_rng(0)
    texts = ["a" * 3_000_000, "é" * 1_500_000, "".join(rng.choice(list("ACGT"), 300_000)),
             "def f(x):\n    return x + 1\n"]
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    proc = prepare_cli(tmp_path / "cache", f"data.sources={src}", "data.vocab_size=400", "data.val_fraction=0")
    try:
        out, err = proc.communicate(timeout=240)  # hours before
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    ds = open_dataset(out.strip().splitlines()[-1])
    tok = Tokenizer.from_str((ds.path / "tokenizer.json").read_text(), ds.manifest["eos_id"], None)
    (bin_path, idx_path, _), = ds.shards("train")
    tokens, ends = np.fromfile(bin_path, ds.dtype), np.fromfile(idx_path, "<u8").astype(np.int64)
    decoded = [tok.decode(d[:-1].tolist()) for d in np.split(tokens, ends[:-1])]  # without EOS
    assert sorted(decoded) == sorted(texts)


def slow_corpus(path: Path) -> None:
    """2 MB of random lowercase words: learning 8192 merges on them takes long enough to be interrupted."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    with open(path, "w") as f:
        for _ in range(20):
            chars = letters[rng.integers(0, 26, 100_000)].copy()
            chars[rng.random(chars.size) < 0.15] = ord(" ")
            f.write(json.dumps({"text": chars.tobytes().decode()}) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_tokenizer_training_stops_it_at_once(tmp_path, sig):
    """The trainer runs in Rust without returning to Python: Ctrl-C was ignored until it ended, and SIGTERM killed
    prepare without a word, leaving the lock file; then SIGTERM exited 130, Ctrl-C's status, instead of 143."""
    src = tmp_path / "words.jsonl"
    slow_corpus(src)
    cache = tmp_path / "cache"
    proc = prepare_cli(cache, f"data.sources={src}", "data.vocab_size=8192")
    try:
        for line in proc.stdout:  # the line that says the merges are being learnt
            if line.startswith("training the tokenizer"):
                break
        else:
            pytest.fail(f"training never started: {proc.wait()} {proc.stderr.read()}")
        assert proc.poll() is None
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)  # the child trainer holds stdout too: it is gone as well
    finally:
        proc.kill()
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert proc.returncode == 128 + sig and f"tokenizer training stopped ({name}); nothing was kept" in out, (out, err)
    assert "Traceback" not in err
    left = [p.relative_to(cache) for p in cache.rglob("*") if p.is_file()]
    assert not [p for p in left if p.suffix == ".lock" or "tokenizer" in p.name], left
