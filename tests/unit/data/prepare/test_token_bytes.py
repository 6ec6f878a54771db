"""Bytes of text per token id, the denominator of bits per byte: exact for byte-level BPE (any text, any
vocabulary size), zero for special tokens, and close for SentencePiece-style tokenizers."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from kiln.data.prepare.token_bytes import token_byte_lengths
from kiln.data.prepare.tokenizer import Tokenizer, train_bpe

TEXTS = [
    "def main():\n    return 42  # the answer\n",
    "Crème brûlée, naïve café: déjà vu. Ελληνικά και русский текст.",
    "日本語のテキストと中文文本，还有表情符号 🙂🚀 and tabs\tand\r\nwindows lines",
    "",
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:12]] + TEXTS[:3]


@pytest.mark.parametrize("vocab", [300, 2000])
def test_byte_level_bpe_counts_every_byte_of_real_text(corpus, vocab):
    tok = train_bpe(corpus, vocab, ["<|endoftext|>"])
    table = token_byte_lengths(tok)
    assert table.shape == (tok.vocab_size,) and table.dtype == np.int64
    for text in [*TEXTS, corpus[0][:5000]]:
        ids = tok.encode(text)
        assert int(table[ids].sum()) == len(tok.decode(ids).encode()) == len(text.encode())


def test_special_tokens_have_no_bytes_and_the_table_pads_to_the_model_vocab(corpus):
    tok = train_bpe(corpus, 300, ["<|endoftext|>", "<|pad|>"])
    table = token_byte_lengths(tok, size=tok.vocab_size + 60)
    assert table[tok.eos_id] == 0 and table[tok.tk.token_to_id("<|pad|>")] == 0
    assert len(table) == tok.vocab_size + 60 and not table[tok.vocab_size:].any()
    assert (table[tok.vocab_size - 10:tok.vocab_size] > 0).all()  # learned merges are text


def test_two_vocabularies_count_the_same_bytes_for_the_same_text(corpus):
    small, large = (train_bpe(corpus, v, ["<|endoftext|>"]) for v in (280, 3000))
    text = corpus[1][:8000]
    a, b = small.encode(text), large.encode(text)
    assert len(a) > len(b)  # different tokenizations of the same text ...
    assert token_byte_lengths(small)[a].sum() == token_byte_lengths(large)[b].sum()  # ... the same bytes


def test_sentencepiece_style_tokenizer_within_a_byte_per_document():
    """A Metaspace BPE with byte fallback: words carry their leading space ('▁'); the first word's space
    is one the decoder drops, so at most one byte more than the decoded text."""
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(TEXTS[:3] * 20, vocab_size=200, special_tokens=["</s>"])
    tok = Tokenizer(sp._tokenizer, eos_token="</s>")
    table = token_byte_lengths(tok)
    assert table[tok.eos_id] == 0
    for text in ("def main(): return 42 the answer", "naïve café déjà vu"):
        ids = tok.encode(text)
        counted, decoded = int(table[ids].sum()), len(tok.decode(ids).encode())
        assert decoded <= counted <= decoded + 1, (text, counted, decoded)
