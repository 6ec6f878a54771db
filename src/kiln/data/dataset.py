"""A prepared dataset directory: open it, check it against a run's tokenizer, verify its shards.

    ds = open_dataset(path, tokenizer_hash=tok.hash)   # DataError if incomplete or another tokenizer
    ds.shards("train")  ->  [(bin_path, idx_path, n_tokens), ...]
    ds.verify()         ->  []  (or one line per problem found)

Layout (`<data.cache_dir>/datasets/<id>/`, the id a hash of inputs, tokenizer and settings):

    manifest.json   written last, so its presence means complete: format, id, dtype, vocab_size,
                    eos_id, bos_id, tokenizer_hash, settings, sources [{path, bytes, sha256}],
                    splits {train/val: {documents, tokens, shards [{name, tokens, documents,
                    sha256}]}}, report
    tokenizer.json  the tokenizer that made it
    report.json     the prepare report
    train/00000.bin flat token ids of whole documents, each [BOS] ... EOS
    train/00000.idx uint64 exclusive end offset of each document within the shard
    val/...         the same for the validation split
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from kiln.data.tokenizer import Tokenizer
from kiln.errors import DataError

FORMAT = "kiln-shards/1"


@dataclass(frozen=True)
class PreparedDataset:
    path: Path
    manifest: dict = field(repr=False)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        file = self.path / "tokenizer.json"
        try:
            text = file.read_text()
        except OSError as e:
            raise DataError(f"{file}: cannot read the dataset's tokenizer ({e.strerror}); prepare it again") from None
        return Tokenizer.from_str(text, self.manifest["eos_id"], self.manifest.get("bos_id"))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["dtype"])

    @property
    def id(self) -> str:
        return self.manifest["id"]

    def split(self, name: str) -> dict:
        return self.manifest["splits"].get(name) or {"documents": 0, "tokens": 0, "shards": []}

    def shards(self, split: str) -> list[tuple[Path, Path, int]]:
        """(bin_path, idx_path, n_tokens) of each shard of `split`, in order."""
        return [(self.path / f"{s['name']}.bin", self.path / f"{s['name']}.idx", int(s["tokens"]))
                for s in self.split(split)["shards"]]

    def verify(self) -> list[str]:
        """Re-hash every shard and the tokenizer; one line per problem (empty: all good)."""
        problems: list[str] = []
        try:
            if Tokenizer.load(self.path / "tokenizer.json").hash != self.manifest["tokenizer_hash"]:
                problems.append("tokenizer.json: its hash differs from the manifest's tokenizer_hash")
        except DataError as e:
            problems.append(str(e))
        item = self.dtype.itemsize
        for split in self.manifest["splits"]:
            for s in self.split(split)["shards"]:
                problems.extend(_check_shard(self.path, s, item))
        return problems


def _check_shard(root: Path, s: dict, item: int) -> list[str]:
    name, out = s["name"], []
    b, x = root / f"{name}.bin", root / f"{name}.idx"
    h = hashlib.sha256()
    try:
        size = 0
        with open(b, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
                size += len(chunk)
        idx = x.read_bytes()
    except OSError as e:
        return [f"{name}: cannot read ({e.strerror})"]
    h.update(idx)
    if size != s["tokens"] * item:
        out.append(f"{name}.bin: {size} bytes, the manifest says {s['tokens']} tokens ({s['tokens'] * item} bytes)")
    ends = np.frombuffer(idx, "<u8")
    if ends.size != s["documents"] or (ends.size and (int(ends[-1]) != s["tokens"] or np.any(np.diff(ends) == 0))):
        out.append(f"{name}.idx: does not describe {s['documents']} documents ending at token {s['tokens']}")
    if h.hexdigest() != s["sha256"]:
        out.append(f"{name}: sha256 differs from the manifest (the shard was modified or damaged)")
    return out


def open_dataset(path: str | Path, tokenizer_hash: str | None = None) -> PreparedDataset:
    """Open a prepared dataset directory; refuse one that is incomplete or made by another tokenizer."""
    p = Path(path).expanduser()
    mf = p / "manifest.json"
    if not p.is_dir():
        raise DataError(f"prepared dataset {p} does not exist; make it with `kiln prepare CONFIG`")
    if not mf.is_file():
        raise DataError(f"prepared dataset {p} is incomplete (no manifest.json): its prepare was interrupted. "
                        "Run the same `kiln prepare` again to finish it")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{mf}: cannot read the manifest ({e}); prepare the dataset again") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{p}: dataset format {manifest.get('format')!r}, this Kiln reads {FORMAT!r}; "
                        "prepare it again with this version")
    if tokenizer_hash is not None and manifest["tokenizer_hash"] != tokenizer_hash:
        raise DataError(f"prepared dataset {p} was tokenized with tokenizer {manifest['tokenizer_hash']}, but this run "
                        f"uses tokenizer {tokenizer_hash}: its token ids would mean other text. Prepare the data "
                        "with the run's tokenizer (data.tokenizer), or train with the dataset's tokenizer.json")
    return PreparedDataset(p, manifest)
