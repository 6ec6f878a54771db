"""Tokenizer: load a file or a directory, train a BPE, explicit BOS/EOS, content hash."""

from __future__ import annotations

import json

import pytest

from kiln.config import DataConfig
from kiln.data.prepare.encode import encode_texts
from kiln.data.prepare.tokenizer import Tokenizer, load_or_train, train_bpe
from kiln.errors import ConfigError, DataError

CORPUS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n"] * 20


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(CORPUS, 300, ["<|endoftext|>", "<s>"]).save(path)
    return path


def test_train_roundtrip_and_specials(tok_file):
    tok = Tokenizer.load(tok_file)
    assert 258 < tok.vocab_size <= 300 and tok.eos_id == 0 and tok.bos_id is None
    text = "def add(x, y):\n    return x - y  # ünïcode ✓\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "a"]) == [tok.encode(text), tok.encode("a")]
    assert Tokenizer.load(tok_file.parent).hash == tok.hash  # a directory holding tokenizer.json
    with_bos = Tokenizer.load(tok_file, bos_token="auto")
    assert with_bos.bos_id == 1 and Tokenizer.load(tok_file, bos_token="<s>").bos_id == 1
    with pytest.raises(DataError, match="data.eos_token='</eos>' is not in the tokenizer's vocabulary"):
        Tokenizer.load(tok_file, eos_token="</eos>")


def test_encode_texts_adds_bos_and_eos(tok_file):
    tok = Tokenizer.load(tok_file, bos_token="<s>")
    import numpy as np

    tokens, lengths = encode_texts(["ab", "", "def"], tok.tk, tok.eos_id, tok.bos_id, np.uint16)
    want = [[1, *tok.encode("ab"), 0], [1, 0], [1, *tok.encode("def"), 0]]
    assert lengths.tolist() == [len(w) for w in want]
    assert tokens.tolist() == [t for w in want for t in w] and tokens.dtype == np.uint16


def test_hash_follows_content(tok_file, tmp_path):
    tok = Tokenizer.load(tok_file)
    data = json.loads(tok_file.read_text())
    (tmp_path / "same.json").write_text(json.dumps(data, indent=4))  # formatting alone keeps the hash
    assert Tokenizer.load(tmp_path / "same.json").hash == tok.hash
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer
    (tmp_path / "changed.json").write_text(json.dumps(data))
    assert Tokenizer.load(tmp_path / "changed.json").hash != tok.hash


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.load(tmp_path / "bad.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty holds no tokenizer files"):
        Tokenizer.load(tmp_path / "empty")


def test_hf_directory_without_tokenizer_json(tok_file, tmp_path):
    """A GPT-2 style directory (vocab.json + merges.txt) is converted through transformers."""
    data = json.loads(tok_file.read_text())
    d = tmp_path / "gpt2ish"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(data["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast",
                                                         "eos_token": "<|endoftext|>"}))
    tok = Tokenizer.load(d)
    ref = Tokenizer.load(tok_file)
    assert tok.eos_id == ref.eos_id
    assert tok.encode("def add(a, b): return a") == ref.encode("def add(a, b): return a")


def test_a_sentencepiece_model_alone_without_sentencepiece_says_to_install_it(tmp_path, monkeypatch):
    """A Llama-2 style directory whose tokenizer is tokenizer.model (SentencePiece) alone, where the sentencepiece
    package is missing: the error said to install tiktoken (transformers' last fallback), which cannot read it."""
    import sys

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # not installed
    d = tmp_path / "llama2"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(bytes(range(256)) * 4)  # a protobuf, not tiktoken's text lines
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"}))
    with pytest.raises(DataError, match=r"SentencePiece model \(tokenizer.model\).*pip install sentencepiece") as e:
        Tokenizer.load(d)
    assert "tiktoken" not in str(e.value)


def test_trained_tokenizer_is_cached(tmp_path):
    cfg = DataConfig(vocab_size=280, bos_token="auto", cache_dir=str(tmp_path))
    a = load_or_train(cfg, iter(CORPUS), "key1", tmp_path)
    assert a.bos_id is not None and a.eos_id == 0
    b = load_or_train(cfg, iter(()), "key1", tmp_path)  # not trained again: nothing to train on here
    assert b.hash == a.hash
    (cached,) = (tmp_path / "tokenizers").glob("bpe-280-*/tokenizer.json")
    cached.write_text(cached.read_text()[:100])  # damaged (a disk filled up, a bad copy): trained again
    assert load_or_train(cfg, iter(CORPUS), "key1", tmp_path).hash == a.hash
    with pytest.raises(DataError, match="too small"):
        load_or_train(cfg.model_copy(update={"vocab_size": 100}), iter(CORPUS), "key2", tmp_path)


def test_a_tokenizer_that_learns_fewer_tokens_than_asked_says_so(tmp_path):
    """data.vocab_size=100000 on a small corpus gave a tokenizer of a few hundred tokens without a word."""
    import io

    from rich.console import Console

    out = io.StringIO()
    cfg = DataConfig(vocab_size=100_000, cache_dir=str(tmp_path))
    tok = load_or_train(cfg, iter(["ab ab ab"]), "key1", tmp_path, Console(file=out, width=300))
    assert tok.vocab_size < 300
    assert f"the tokenizer learned {tok.vocab_size:,} tokens, fewer than data.vocab_size=100,000" in out.getvalue()


def _with_template(single: str | None):
    """A BPE with Llama's specials (<unk>, <s>, </s>) whose post-processor is `single` (None: none)."""
    from tokenizers import processors

    tk = train_bpe(CORPUS, 300, ["<unk>", "<s>", "</s>"]).tk
    if single is not None:
        tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return tk


def test_bos_follows_the_tokenizers_post_processor():
    assert Tokenizer(_with_template("<s> $A"), bos_token="tokenizer").bos_id == 1
    assert Tokenizer(_with_template("<s> $A </s>"), bos_token="tokenizer").bos_id == 1
    assert Tokenizer(_with_template("$A </s>"), bos_token="tokenizer").bos_id is None
    assert Tokenizer(_with_template(None), bos_token="tokenizer").bos_id is None
    assert Tokenizer(_with_template("<s> $A"), bos_token=None).bos_id is None  # the setting still overrides


def test_init_from_defaults_bos_to_the_tokenizers_own(tmp_path):
    from kiln.config import RunConfig, load_config

    cfg = load_config(None, [f"model.init_from={tmp_path}"])
    assert (cfg.data.tokenizer, cfg.data.bos_token) == (str(tmp_path), "tokenizer")
    assert load_config(None, [f"model.init_from={tmp_path}", "data.bos_token=null"]).data.bos_token is None
    assert load_config(None, []).data.bos_token is None  # from scratch: none, as before
    given = RunConfig.model_validate({"model": {"init_from": str(tmp_path)}, "data": DataConfig(bos_token="<s>")})
    assert given.data.bos_token == "<s>"
    with pytest.raises(ConfigError, match="bos_token=tokenizer follows a given tokenizer"):
        load_config(None, ["data.bos_token=tokenizer"])


def test_auto_eos_of_a_model_directory_is_the_one_its_tokenizer_config_names(tmp_path):
    """A model whose EOS has none of the usual names (DeepSeek's <｜end▁of▁sentence｜>) stopped `kiln train
    model.init_from=DIR` with 'the tokenizer has no end-of-text token', though its tokenizer_config.json names it."""
    eos = "<｜end▁of▁sentence｜>"
    train_bpe(CORPUS, 300, [eos, "<|im_end|>"]).save(tmp_path / "tokenizer.json")
    assert Tokenizer.load(tmp_path).eos_id is None  # no tokenizer_config.json: nothing names it
    for named in (eos, {"content": eos, "special": True}):  # both forms transformers writes
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": named}))
        assert Tokenizer.load(tmp_path).eos_id == 0 and Tokenizer.load(tmp_path / "tokenizer.json").eos_id is None
    train_bpe(CORPUS, 300, ["<|endoftext|>", "<|im_end|>"]).save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert Tokenizer.load(tmp_path).eos_id == 0  # a chat model's turn end: the usual name first, as before
