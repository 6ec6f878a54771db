"""Tokenizer: load a tokenizer.json (or a directory holding one), or train a byte-level BPE.

Trained tokenizers are cached under the hash of what they were trained on, and every tokenizer
carries a content hash that prepared datasets and checkpoints record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from kiln.errors import DataError

EOS = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper over a Hugging Face `tokenizers.Tokenizer` with a content hash."""

    def __init__(self, tk):
        self.tk = tk
        self.hash = hashlib.sha256(tk.to_str().encode()).hexdigest()[:16]
        eos = tk.token_to_id(EOS)
        if eos is None:
            for name in ("</s>", "<|end_of_text|>", "<eos>"):
                eos = tk.token_to_id(name)
                if eos is not None:
                    break
        self.eos_id = eos

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=False)

    def save(self, path: Path) -> None:
        self.tk.save(str(path))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(f"tokenizer file {p} does not exist; give a tokenizer.json or a directory holding one")
        try:
            return cls(HFTokenizer.from_file(str(p)))
        except Exception as e:  # the Rust side raises plain Exceptions on bad JSON
            raise DataError(f"{p}: not a valid tokenizer.json ({e})") from None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation) with an end-of-text token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tk)


def trained_or_cached(texts_key: str, texts: Iterable[str], vocab_size: int, cache_dir: Path) -> Tokenizer:
    """Train a BPE on `texts`, or reuse the one trained before on the same inputs and size."""
    path = cache_dir / "tokenizers" / f"bpe-{vocab_size}-{texts_key[:16]}" / "tokenizer.json"
    if path.is_file():
        return Tokenizer.load(path)
    tok = train_bpe(texts, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(tmp)
    tmp.replace(path)
    return tok
