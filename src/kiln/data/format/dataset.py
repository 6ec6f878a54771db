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

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from kiln.data.prepare.tokenizer import Tokenizer
from kiln.errors import DataError
from kiln.files import hash_stream

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

    def damage(self) -> str | None:
        """A cheap check, from file sizes alone, that every file the manifest names is in place: the
        first problem found, or None. (A changed byte of the same size needs `verify`.)"""
        if not (self.path / "tokenizer.json").is_file():
            return "tokenizer.json is missing"
        item = self.dtype.itemsize
        for split in self.manifest["splits"]:
            for s in self.split(split)["shards"]:
                for suffix, size in ((".bin", s["tokens"] * item), (".idx", s["documents"] * 8)):
                    f = self.path / f"{s['name']}{suffix}"
                    try:
                        actual = f.stat().st_size
                    except OSError as e:
                        return f"{s['name']}{suffix}: {e.strerror}"
                    if actual != size:
                        return f"{s['name']}{suffix}: {actual} bytes, the manifest says {size}"
        return None

    def verify(self) -> list[str]:
        """Re-hash every shard and the tokenizer; one line per problem (empty: all good). Shard files
        that the manifest does not name are problems too (a manifest edited to drop a shard)."""
        problems: list[str] = []
        try:
            text = (self.path / "tokenizer.json").read_text()
            if Tokenizer.from_str(text, None, None).hash != self.manifest["tokenizer_hash"]:
                problems.append("tokenizer.json: its hash differs from the manifest's tokenizer_hash")
        except OSError as e:
            problems.append(f"tokenizer.json: cannot read ({e.strerror})")
        except Exception as e:  # the Rust side raises plain Exceptions on bad JSON
            problems.append(f"tokenizer.json: not a valid tokenizer ({e})")
        item = self.dtype.itemsize
        for split in self.manifest["splits"]:
            for s in self.split(split)["shards"]:
                problems.extend(_check_shard(self.path, s, item))
        named = {f"{s['name']}{x}" for sp in self.manifest["splits"] for s in self.split(sp)["shards"]
                 for x in (".bin", ".idx")}
        for split in self.manifest["splits"]:
            d = self.path / split
            for f in sorted(d.iterdir()) if d.is_dir() else []:
                if f.suffix in (".bin", ".idx") and f"{split}/{f.name}" not in named:
                    problems.append(f"{split}/{f.name}: a shard file the manifest does not name")
        return problems


def _check_shard(root: Path, s: dict, item: int) -> list[str]:
    name, out = s["name"], []
    b, x = root / f"{name}.bin", root / f"{name}.idx"
    try:
        with open(b, "rb") as f:
            h, size = hash_stream(f)
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


def manifest_problems(m) -> list[str]:
    """What is missing or inconsistent in a manifest's structure (empty: none)."""
    if not isinstance(m, dict):
        return ["it is not a JSON object"]
    out = [f"no {k!r}" for k in ("id", "dtype", "vocab_size", "eos_id", "tokenizer_hash", "splits") if k not in m]
    if out:
        return out
    if m["dtype"] not in ("uint16", "uint32"):
        out.append(f"dtype {m['dtype']!r} is not uint16 or uint32")
    splits = m["splits"]
    if not isinstance(splits, dict) or "train" not in splits:
        return [*out, "no 'train' split"]
    for name, sp in splits.items():
        try:
            shards = sp["shards"]
            for i, s in enumerate(shards):
                if s["name"] != f"{name}/{i:05d}" or int(s["tokens"]) < 1 or int(s["documents"]) < 1 \
                        or not isinstance(s["sha256"], str):
                    out.append(f"split {name!r}: shard entry {i} is not {name}/{i:05d} with tokens, documents, sha256")
                    break
            else:
                for k in ("tokens", "documents"):
                    if int(sp[k]) != sum(int(s[k]) for s in shards):
                        out.append(f"split {name!r}: {k} {sp[k]} is not the sum over its {len(shards)} shard(s)")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            out.append(f"split {name!r}: malformed ({e!r})")
    return out


def open_dataset(path: str | Path, tokenizer_hash: str | None = None) -> PreparedDataset:
    """Open a prepared dataset directory; refuse one that is incomplete or made by another tokenizer."""
    p = Path(path).expanduser()
    mf = p / "manifest.json"
    if p.is_file():
        raise DataError(f"{p} is a file, not a prepared dataset (a directory under <data.cache_dir>/datasets/ "
                        "that `kiln prepare` printed)")
    if not p.is_dir():
        raise DataError(f"prepared dataset {p} does not exist; make it with `kiln prepare CONFIG`")
    if not mf.is_file() and not (p / "train").is_dir():
        raise DataError(f"{p} is not a prepared dataset (no manifest.json, no train/ shards): give the directory "
                        "`kiln prepare` printed, under <data.cache_dir>/datasets/")
    if not mf.is_file():
        raise DataError(f"prepared dataset {p} is incomplete (no manifest.json): its prepare was interrupted. "
                        "Run the same `kiln prepare` again to finish it")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{mf}: cannot read the manifest ({e}); run the same `kiln prepare` again: it "
                        "replaces a damaged dataset") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt != FORMAT:
        raise DataError(f"{p}: dataset format {fmt!r}, this Kiln reads {FORMAT!r}; "
                        "prepare it again with this version")
    problems = manifest_problems(manifest)
    if problems:
        raise DataError(f"{mf}: the manifest is damaged ({'; '.join(problems)}); run the same `kiln prepare` "
                        "again: it replaces a damaged dataset")
    if tokenizer_hash is not None and manifest["tokenizer_hash"] != tokenizer_hash:
        raise DataError(f"prepared dataset {p} was tokenized with tokenizer {manifest['tokenizer_hash']}, but this run "
                        f"uses tokenizer {tokenizer_hash}: its token ids would mean other text. Prepare the data "
                        "with the run's tokenizer (data.tokenizer), or train with the dataset's tokenizer.json")
    return PreparedDataset(p, manifest)
