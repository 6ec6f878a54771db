"""Prepare: sources -> tokenized, content-addressed token files plus a manifest.

The dataset directory's name is a hash of the inputs' contents, the tokenizer and the settings,
so a changed input can never reuse a stale dataset. The manifest is written last: a directory
without one is incomplete and is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.config import DataConfig
from kiln.data.sources import expand, read_documents
from kiln.data.tokenizer import Tokenizer, trained_or_cached
from kiln.errors import DataError

BATCH_DOCS = 256


@dataclass(frozen=True)
class PreparedDataset:
    path: Path
    manifest: dict

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.path / "tokenizer.json")

    def split_path(self, split: str) -> Path:
        return self.path / f"{split}.bin"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["dtype"])


def _hash_files(files: list[Path], max_bytes: int | None) -> str:
    h, total = hashlib.sha256(), 0
    for f in files:
        raw = f.read_bytes()
        h.update(str(len(raw)).encode() + b"\0" + raw)
        total += len(raw)
        if max_bytes is not None and total >= max_bytes:
            break
    return h.hexdigest()


def _is_val(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def prepare(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> PreparedDataset:
    cache = Path(cfg.cache_dir).expanduser()
    files = expand(cfg.sources)
    inputs_hash = _hash_files(files, cfg.max_bytes)
    if tokenizer is None:
        if cfg.tokenizer:
            tokenizer = Tokenizer.load(cfg.tokenizer)
        else:
            texts = (d.text for d in read_documents(files, cfg.max_bytes))
            tokenizer = trained_or_cached(inputs_hash, texts, cfg.vocab_size, cache)
    settings = {"max_bytes": cfg.max_bytes, "val_fraction": cfg.val_fraction, "eos": tokenizer.eos_id}
    key = hashlib.sha256(json.dumps([inputs_hash, tokenizer.hash, settings]).encode()).hexdigest()[:16]
    out = cache / "datasets" / key
    if (out / "manifest.json").is_file():
        return PreparedDataset(out, json.loads((out / "manifest.json").read_text()))

    if tokenizer.eos_id is None:
        raise DataError("the tokenizer has no end-of-text token (<|endoftext|>, </s> or <eos>); add one")
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
    with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
        batch: list[str] = []

        def flush() -> None:
            for text, ids in zip(batch, tokenizer.encode_batch(batch)):
                split = "val" if _is_val(text, cfg.val_fraction) else "train"
                arr = np.asarray(ids + [tokenizer.eos_id], dtype=dtype)
                (fval if split == "val" else ftrain).write(arr.tobytes())
                counts[split][0] += 1
                counts[split][1] += len(arr)
            batch.clear()

        for doc in read_documents(files, cfg.max_bytes):
            batch.append(doc.text)
            if len(batch) >= BATCH_DOCS:
                flush()
        flush()
    if counts["train"][1] == 0:
        raise DataError(f"no training tokens from data.sources={cfg.sources}: the inputs are empty")
    tokenizer.save(tmp / "tokenizer.json")
    manifest = {
        "id": key, "inputs_hash": inputs_hash, "tokenizer_hash": tokenizer.hash, "settings": settings,
        "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size,
        "splits": {s: {"documents": d, "tokens": t} for s, (d, t) in counts.items()},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return PreparedDataset(out, manifest)
