"""The settings that name cached work: every cache key of the data pipeline derives from `read_settings`.

    read_settings(cfg)                 what decides the documents read from given source bytes
    read_forms(files)                  how each source file is read: its format and compression, which
                                       data.format=auto infers from the file's name
    dataset_settings(cfg, tokenizer, files)   + what decides the shards made of them (a dataset's id)
    tokenizer_key(cfg, sources)        a BPE trained on the sources: its cache key

A setting that changes which documents come out of the sources (a reader's version, the format,
the field, a length filter, data.on_bad_record, ...) is added once, in `read_settings`, and so
changes the prepared dataset's id, the key of a tokenizer trained by `kiln prepare` and that of
one trained for streaming alike: no cache can be reused by a run whose settings would have made
something else. The same bytes under another name can be read another way (JSON lines in
`corpus.txt` are one text document, in `corpus.jsonl` a record each): what a file's name decides
is in `read_forms`, beside each file's content hash.
"""

from __future__ import annotations

import hashlib
import json

from kiln.data.prepare.bpe import EOS
from kiln.data.read.sources import READERS_VERSION

# How a BPE is trained here: raised when the same texts would give another tokenizer (as when words
# longer than the trainer's cap began to be cut), so tokenizers trained the old way are not reused
TRAINER_VERSION = 2


def digest(obj) -> str:
    """sha256 of the canonical JSON of `obj`."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def read_settings(cfg) -> dict:
    """Everything besides the sources' bytes that decides which documents a DataConfig reads from them."""
    return {"readers": READERS_VERSION, "format": cfg.format, "text_unit": cfg.text_unit, "field": cfg.field,
            "csv_quoting": cfg.csv_quoting, "dataset_split": cfg.dataset_split,
            "max_record_bytes": cfg.max_record_bytes, "min_chars": cfg.min_chars, "max_chars": cfg.max_chars,
            "on_bad_record": cfg.on_bad_record}


def read_forms(files) -> list[str]:
    """How each source file (a kiln.data.read.sources.SourceFile) is read, in order: 'jsonl', 'text+gzip',
    'text!lenient' (bad records skipped whatever the policy)."""
    return [sf.format + (f"+{sf.compression}" if sf.compression else "") + ("!lenient" if sf.lenient else "")
            for sf in files]


def dataset_settings(cfg, tokenizer, files) -> dict:
    """Everything besides the source bytes and the tokenizer that changes the prepared tokens."""
    return {**read_settings(cfg), "reads": read_forms(files), "max_bytes": cfg.max_bytes, "dedup": cfg.dedup,
            "val_fraction": cfg.val_fraction, "shard_tokens": cfg.shard_tokens,
            "parse_special_tokens": cfg.parse_special_tokens, "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id}


def train_chars(cfg) -> int:
    """Characters of documents a tokenizer trained here learns from."""
    return min(cfg.tokenizer_train_bytes, cfg.max_bytes or cfg.tokenizer_train_bytes)


def special_tokens(cfg) -> tuple[str, str | None, list[str]]:
    """(eos, bos or None, the special tokens in vocabulary order) of a tokenizer trained for `cfg`."""
    eos = EOS if cfg.eos_token == "auto" else cfg.eos_token
    bos = None if cfg.bos_token is None else "<|startoftext|>" if cfg.bos_token == "auto" else cfg.bos_token
    return eos, bos, [eos] + ([bos] if bos is not None and bos != eos else [])


def tokenizer_key(cfg, sources) -> str:
    """Cache key (16 hex digits) of a BPE trained for `cfg` on `sources` (what names their content and how it is
    read: their sha256s with their read_forms, or for streaming their names and sizes)."""
    return digest({"sources": sources, "read": read_settings(cfg), "train_chars": train_chars(cfg),
                   "vocab_size": cfg.vocab_size, "specials": special_tokens(cfg)[2],
                   "trainer": TRAINER_VERSION})[:16]
