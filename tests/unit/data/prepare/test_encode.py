"""encode: batches encoded in worker processes equal those encoded in this one, forked or spawned."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from kiln.data.prepare import encode
from kiln.data.prepare.encode import Encoder
from kiln.data.prepare.tokenizer import Tokenizer, train_bpe
from kiln.data.read.sources import stdlib_files


@pytest.fixture(scope="module")
def texts_and_tokenizer(tmp_path_factory):
    texts = [p.read_text() for p in stdlib_files()[300:360]]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(texts, 4000).save(path)  # pickled, larger than a pipe buffer (64 KB)
    return texts, str(path)


def _encode_all(tok, texts, workers):
    enc = Encoder(tok, np.uint16, workers)
    try:
        for i in range(0, len(texts), 7):
            enc.submit(i, texts[i:i + 7])
        return [(tag, tokens.tolist(), lengths.tolist()) for tag, tokens, lengths in enc.results(drain=True)]
    finally:
        enc.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_encode_like_this_process(texts_and_tokenizer, monkeypatch, method):
    texts, path = texts_and_tokenizer
    tok = Tokenizer.load(path, bos_token=None)
    local = _encode_all(tok, texts, 1)
    monkeypatch.setattr(encode, "START_METHOD", method)
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kiln-tokenizer-*")))
    assert _encode_all(tok, texts, 2) == local
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kiln-tokenizer-*"))) == before  # no file left


def test_spawned_workers_of_a_script_without_main_guard_fail_with_advice(texts_and_tokenizer, tmp_path):
    """A spawned worker imports the script, which calls prepare again: the run must stop with a message
    that says what to do, not wait forever on the worker."""
    texts, path = texts_and_tokenizer
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = {"sources": [str(src)], "tokenizer": path, "cache_dir": str(tmp_path / "cache"), "workers": 2,
           "max_bytes": None}
    script = tmp_path / "script.py"
    script.write_text("import json\nfrom kiln.config import DataConfig\n"
                      "from kiln.data.prepare import encode, pipeline as p\n"
                      "encode.START_METHOD = 'spawn'\np.POOL_MIN_BYTES = 0\n"
                      f"p.prepare(DataConfig(**json.loads({json.dumps(json.dumps(cfg))})))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode != 0
    assert "while a worker process was starting" in r.stderr  # the worker's own error
    assert "tokenizer worker process died" in r.stderr and "failed while starting" in r.stderr
